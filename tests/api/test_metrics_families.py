"""vLLM's request and iteration metric families on /metrics, and the one table they come from.

The fake engine stamps its outputs on a fixed engine clock (queued 100.0,
scheduled 100.25, first token 100.5, one more every 0.125 s), so the phase
histograms have exact sums.
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocol import SchedulerStats
from protocol.engine import (
    ITERATION_TOKENS_BUCKETS,
    SCHEDULER_STATS_DELTAS,
    without_deltas,
)
from services.api.engine_client import RankStats, add_deltas
from services.api.metrics import (
    RANK_FAMILIES,
    REQUEST_FAMILIES,
    APIMetrics,
    one_two_five_buckets,
)
from services.api.reliability_metrics import RELIABILITY_FAMILIES
from tests.api.fake_engine_client import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    http_client,
    make_app,
)


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, its labels) -> value, for every sample of an exposition."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: dict, name: str, **labels: str) -> float:
    return found[(name, frozenset({"model_name": MODEL_NAME, "engine": "0", **labels}.items()))]


@pytest.fixture
async def scraped():
    app, _ = make_app()
    client = http_client(app)
    response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "n": 2})
    assert response.status_code == 200
    assert (await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})).status_code == 200
    return samples((await client.get("/metrics")).text)


def test_request_token_and_param_histograms(scraped):
    # Three engine requests (n=2 fans out): 5 + 5 + 3 tokens generated, 1 prompt token each.
    assert value(scraped, "vllm:request_generation_tokens_count") == 3
    assert value(scraped, "vllm:request_generation_tokens_sum") == 13
    assert value(scraped, "vllm:request_generation_tokens_bucket", le="5.0") == 3
    assert value(scraped, "vllm:request_generation_tokens_bucket", le="2.0") == 0
    assert value(scraped, "vllm:request_prompt_tokens_sum") == 3
    # The parameters are the HTTP request's: observed once per request, not per choice.
    assert value(scraped, "vllm:request_params_n_count") == 2
    assert value(scraped, "vllm:request_params_n_sum") == 3
    assert value(scraped, "vllm:request_params_n_bucket", le="1.0") == 1
    assert value(scraped, "vllm:request_params_max_tokens_sum") == 8


def test_phase_histograms_use_the_engine_clock(scraped):
    assert value(scraped, "vllm:request_queue_time_seconds_sum") == pytest.approx(3 * 0.25)
    assert value(scraped, "vllm:request_prefill_time_seconds_sum") == pytest.approx(3 * 0.25)
    # Decode = first -> last token: 4 gaps of 0.125 twice, 2 gaps once.
    assert value(scraped, "vllm:request_decode_time_seconds_sum") == pytest.approx(0.125 * (4 + 4 + 2))
    assert value(scraped, "vllm:request_inference_time_seconds_sum") == pytest.approx(
        3 * 0.25 + 0.125 * (4 + 4 + 2)
    )
    # Per request: decode time over the tokens after the first one.
    assert value(scraped, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(3 * 0.125)


def test_inter_token_latency_has_both_names(scraped):
    count = value(scraped, "vllm:inter_token_latency_seconds_count")
    assert count == 4 + 4 + 2
    assert value(scraped, "vllm:time_per_output_token_seconds_count") == count
    assert value(scraped, "vllm:time_to_first_token_seconds_count") == 3
    assert value(scraped, "vllm:e2e_request_latency_seconds_count") == 3


def test_cache_config_info_is_a_gauge_of_one_labelled_by_the_config(scraped):
    [(labels, gauge)] = [(dict(k[1]), v) for k, v in scraped.items() if k[0] == "vllm:cache_config_info"]
    assert gauge == 1.0
    assert labels["block_size"] == "16" and labels["enable_prefix_caching"] == "True"
    assert labels["engine"] == "0" and "num_gpu_blocks" in labels


def test_token_histograms_use_1_2_5_buckets_up_to_max_model_len(scraped):
    bounds = sorted(
        float(dict(k[1])["le"])
        for k in scraped
        if k[0] == "vllm:request_prompt_tokens_bucket" and dict(k[1])["le"] != "+Inf"
    )
    assert bounds == [float(b) for b in one_two_five_buckets(MAX_MODEL_LEN)]
    assert one_two_five_buckets(256) == (1, 2, 5, 10, 20, 50, 100, 200)


def test_iteration_tokens_histogram_from_the_engines_counts():
    rank = RankStats(rank=0)
    counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    counts[0], counts[3] = 2, 1  # two 1-token steps, one step of 17..32 tokens
    rank.totals.iteration_tokens_counts, rank.totals.iteration_tokens_sum = counts, 32
    found = samples(APIMetrics(lambda: {0: rank}, MODEL_NAME).exposition().decode())
    assert value(found, "vllm:iteration_tokens_total_bucket", le="1.0") == 2
    assert value(found, "vllm:iteration_tokens_total_bucket", le="16.0") == 2
    assert value(found, "vllm:iteration_tokens_total_bucket", le="32.0") == 3
    assert value(found, "vllm:iteration_tokens_total_count") == 3
    assert value(found, "vllm:iteration_tokens_total_sum") == 32


def test_each_metric_is_declared_once():
    names = (
        [f.name for f, _ in RANK_FAMILIES]
        + [f.name for f in REQUEST_FAMILIES]
        + [f.name for f, _ in RELIABILITY_FAMILIES]
    )
    assert len(names) == len(set(names))
    # The API sums exactly the engine's deltas into its totals, and a heartbeat zeroes them.
    rank = RankStats(rank=0)
    for _ in range(2):
        add_deltas(
            rank, SchedulerStats(prefix_cache_queries=3, iteration_tokens_counts=[1, 2], num_running_reqs=5)
        )
    assert (rank.totals.prefix_cache_queries, rank.totals.iteration_tokens_counts) == (6, [2, 4])
    assert rank.totals.num_running_reqs == 0  # not a delta: never summed
    zeroed = without_deltas(
        SchedulerStats(prefix_cache_queries=3, iteration_tokens_counts=[1], num_running_reqs=2)
    )
    assert zeroed.num_running_reqs == 2 and not any(getattr(zeroed, n) for n in SCHEDULER_STATS_DELTAS)


def test_every_declared_family_is_served():
    text = APIMetrics(lambda: {0: RankStats(rank=0)}, MODEL_NAME).exposition().decode()
    served = {family.name for family in text_string_to_metric_families(text)}
    # Request families are registered up front, so they are served (empty) before any request.
    assert {f.name for f, _ in RANK_FAMILIES} | {f.name for f in REQUEST_FAMILIES} <= served
