"""The small routes: health, version, models, tokenize, metrics, lifespan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.api.engine_client import RankStats
from tests.api.fake_engine_client import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    FakeEngineClient,
    http_client,
    make_app,
    tokenizer,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def served():
    app, engine = make_app()
    return http_client(app), engine


async def test_health_version_models(served):
    client, _ = served
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/version")).json()["version"]
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    [card] = models["data"]
    assert card["id"] == MODEL_NAME and card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN


async def test_served_model_name_overrides_config():
    app, _ = make_app(served_model_name="alias")
    client = http_client(app)
    assert (await client.get("/v1/models")).json()["data"][0]["id"] == "alias"
    assert (
        await client.post("/v1/completions", json={"prompt": "x", "model": "alias", "max_tokens": 1})
    ).status_code == 200
    assert (
        await client.post("/v1/completions", json={"prompt": "x", "model": MODEL_NAME})
    ).status_code == 400


async def test_health_names_waiting_ranks():
    engine = FakeEngineClient(num_ranks=2)
    engine.ranks[1] = RankStats(1, state="waiting")
    app, _ = make_app(engine)
    response = await http_client(app).get("/health")
    assert response.status_code == 503
    assert response.json()["ready"] == [0] and response.json()["waiting"] == [1]


async def test_tokenize_and_detokenize(served):
    client, _ = served
    ids = tokenizer().encode("Hello there")
    response = (await client.post("/tokenize", json={"prompt": "Hello there"})).json()
    assert response == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids}
    messages = [{"role": "user", "content": "Hi"}]
    chat = (await client.post("/tokenize", json={"messages": messages})).json()
    expected = tokenizer().encode(tokenizer().apply_chat_template(messages), add_special_tokens=False)
    assert chat["tokens"] == expected
    assert (await client.post("/detokenize", json={"tokens": ids})).json() == {"prompt": "Hello there"}
    for bad in ({}, {"prompt": "x", "messages": messages}):
        assert (await client.post("/tokenize", json=bad)).status_code == 400
    assert (await client.post("/detokenize", json={"tokens": [10**6]})).status_code == 400


async def test_metrics_exposes_vllm_names(served):
    client, engine = served
    engine.ranks[0].num_running, engine.ranks[0].kv_cache_usage = 3, 0.25
    engine.ranks[0].totals.prefix_cache_queries, engine.ranks[0].totals.prefix_cache_hits = 100, 40
    await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
    await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 40, "stop": "STOP"})
    text = (await client.get("/metrics")).text
    labels = f'engine="0",model_name="{MODEL_NAME}"'
    for line in (
        f"vllm:num_requests_running{{{labels}}} 3.0",
        f"vllm:num_requests_waiting{{{labels}}} 0.0",
        f"vllm:kv_cache_usage_perc{{{labels}}} 0.25",
        f"vllm:prefix_cache_queries_total{{{labels}}} 100.0",
        f"vllm:prefix_cache_hits_total{{{labels}}} 40.0",
        f"vllm:num_preemptions_total{{{labels}}} 0.0",
        f"vllm:generation_tokens_total{{{labels}}} 19.0",
        f"vllm:prompt_tokens_total{{{labels}}} 2.0",
        f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{MODEL_NAME}"}} 1.0',
        f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="{MODEL_NAME}"}} 1.0',
        f"vllm:request_queue_time_seconds_sum{{{labels}}} 0.5",
        f"vllm:e2e_request_latency_seconds_count{{{labels}}} 2.0",
        f"vllm:time_to_first_token_seconds_count{{{labels}}} 2.0",
        f"vllm:inter_token_latency_seconds_count{{{labels}}} 17.0",
    ):
        assert line in text, line


async def test_lifespan_starts_and_shuts_down_the_engine_client():
    app, engine = make_app()
    async with app.router.lifespan_context(app):
        assert engine.started and not engine.shut_down
    assert engine.shut_down


def test_the_app_never_imports_torch():
    code = (
        "import sys, services.api.app; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, timeout=60)
