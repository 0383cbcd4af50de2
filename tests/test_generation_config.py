"""The model's generation_config.json, read as vLLM reads it."""

from __future__ import annotations

import json

import msgspec
import pytest

from protocol import SamplingParams
from services.config.engine_args import EngineArgs
from services.generation_config import (
    extra_eos_token_ids,
    read_generation_config,
    sampling_defaults,
    with_extra_eos,
)
from tests.api.fake_engine_client import (
    MODEL_NAME,
    engine_config,
    make_app,
    openai_client,
)

pytestmark = pytest.mark.slow


def write(folder, name, value) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(value))


def test_modes_auto_vllm_and_folder(tmp_path):
    model = tmp_path / "model"
    write(model, "config.json", {"eos_token_id": [2, 7], "temperature": 0.5})
    assert read_generation_config("auto", model) == {
        "eos_token_id": [2, 7],
        "temperature": 0.5,
    }  # from config.json
    write(model, "generation_config.json", {"eos_token_id": 9, "top_p": 0.9, "do_sample": True})
    assert read_generation_config("auto", model)["top_p"] == 0.9
    assert read_generation_config("vllm", model) == {}
    other = tmp_path / "other"
    write(other, "generation_config.json", {"temperature": 0.1})
    assert read_generation_config(str(other), model) == {"temperature": 0.1}
    with pytest.raises(ValueError, match="generation_config.*does not exist"):
        read_generation_config(str(tmp_path / "nowhere"), model)


def test_sampling_defaults_and_extra_eos():
    config = {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "max_new_tokens": 256,
        "do_sample": True,
        "eos_token_id": [151645, 151643],
    }
    assert sampling_defaults(config) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 256}
    assert extra_eos_token_ids(config, 151645) == [151643]
    assert extra_eos_token_ids({"eos_token_id": 3}, 3) == []
    with pytest.raises(ValueError, match="temperature"):
        sampling_defaults({"temperature": "hot"})
    with pytest.raises(ValueError, match="eos_token_id"):
        extra_eos_token_ids({"eos_token_id": ["x"]}, None)
    params = with_extra_eos(SamplingParams(stop_token_ids=[5]), [8, 5])
    assert params.stop_token_ids == [5, 8]
    assert with_extra_eos(SamplingParams(ignore_eos=True), [8]).stop_token_ids is None


def test_engine_args_carry_them_into_the_model_config(tiny_model_dir, tmp_path):
    write(tiny_model_dir, "generation_config.json", {"eos_token_id": [2, 11], "temperature": 0.7})
    model = EngineArgs(model=str(tiny_model_dir), device="cpu").create_engine_config().model
    assert model.generation_defaults == {"temperature": 0.7} and model.extra_eos_token_ids == [11]
    plain = EngineArgs(
        model=str(tiny_model_dir), device="cpu", generation_config="vllm"
    ).create_engine_config()
    assert plain.model.generation_defaults == {} and plain.model.extra_eos_token_ids == []


async def test_api_applies_the_defaults_a_request_leaves_unset():
    base = engine_config()
    model = msgspec.structs.replace(
        base.model,
        generation_defaults={"temperature": 0.3, "top_p": 0.8, "max_tokens": 7},
        extra_eos_token_ids=[42],
    )
    app, engine = make_app(config=msgspec.structs.replace(base, model=model))
    client = openai_client(app)
    await client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}])
    params = engine.requests[-1].sampling_params
    assert (params.temperature, params.top_p, params.max_tokens, params.stop_token_ids) == (0.3, 0.8, 7, [42])
    await client.completions.create(
        model=MODEL_NAME,
        prompt="Hi",
        temperature=1.0,
        top_p=1.0,
        max_tokens=3,
        extra_body={"ignore_eos": True},
    )
    params = engine.requests[-1].sampling_params
    assert (params.temperature, params.top_p, params.max_tokens, params.stop_token_ids) == (1.0, 1.0, 3, None)


@pytest.fixture
def tiny_model_dir(tmp_path):
    from tests.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path / "tiny")


def test_offline_generation_stops_at_an_extra_eos(tiny_model_dir):
    from services import LLM

    prompt = "The capital of France is"
    llm = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        num_gpu_blocks_override=64,
        block_size=16,
        max_model_len=512,
        num_threads=1,
        generation_config="vllm",
    )
    try:
        free = (
            llm.generate(
                [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
            )[0]
            .outputs[0]
            .token_ids
        )
    finally:
        llm.shutdown()
    stop_at = next(i for i, t in enumerate(free) if t not in free[:i] and i >= 3)  # a first occurrence
    write(
        tiny_model_dir,
        "generation_config.json",
        {"eos_token_id": [0, free[stop_at]], "temperature": 0.0, "max_new_tokens": 12},
    )
    llm = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        num_gpu_blocks_override=64,
        block_size=16,
        max_model_len=512,
        num_threads=1,
    )
    try:
        assert llm.get_default_sampling_params().temperature == 0.0
        out = llm.generate([prompt], use_tqdm=False)[0].outputs[0]  # the model's defaults: greedy, 12 tokens
    finally:
        llm.shutdown()
    assert out.token_ids == free[: stop_at + 1]
    assert out.finish_reason == "stop" and out.stop_reason == free[stop_at]
