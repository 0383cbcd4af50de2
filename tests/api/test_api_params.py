"""Request parameters honoured or refused, in-process (FakeEngineClient, the official client).

Expected outputs follow vLLM's documented behaviour: echo puts the prompt
(and its logprobs, the first null) in front; continuous_usage_stats puts
usage on every chunk; stream_options needs stream; suffix and best_of != n
are refused; unknown fields are a 400 naming them.
"""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest

from services.api.api_options import APIOptions, api_options
from services.api.server import build_parser
from tests.api.fake_engine_client import (
    MODEL_NAME,
    SCRIPT,
    FakeEngineClient,
    http_client,
    make_app,
    openai_client,
    tokenizer,
)

PROMPT = "Hi there"


@pytest.fixture
def served():
    app, engine = make_app()
    return openai_client(app), engine


async def post(app, path: str, body: dict) -> httpx.Response:
    async with http_client(app) as http:
        return await http.post(path, json=body)


def script_text(num_tokens: int) -> str:
    return tokenizer().decode(tokenizer().encode(SCRIPT, add_special_tokens=False)[:num_tokens])


# ---- unknown fields


async def test_unknown_fields_are_a_400_naming_every_one():
    app, engine = make_app()
    for path, base in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        response = await post(app, path, {**base, "temprature": 0.5, "max_tokns": 3})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "temprature"
        assert "temprature" in error["message"] and "max_tokns" in error["message"]
    assert engine.requests == []


async def test_allow_unknown_fields_serves_and_logs_them(caplog):
    app, engine = make_app(options=APIOptions(allow_unknown_fields=True))
    with caplog.at_level(logging.WARNING, logger="services.api.unknown_fields"):
        response = await post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "extra_knob": 1})
    assert response.status_code == 200 and len(engine.requests) == 1
    assert "extra_knob" in caplog.text


async def test_a_nested_shape_error_is_still_a_400_with_its_path():
    app, _ = make_app()
    response = await post(
        app, "/v1/completions", {"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": "yes"}}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options.include_usage"


# ---- token filters reach the engine


async def test_logit_bias_allowed_token_ids_and_bad_words_reach_the_sampler(served):
    client, engine = served
    await client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=2,
        logit_bias={"42": -100, "7": 3.5},
        extra_body={"allowed_token_ids": [42, 7, 9, 42], "bad_words": ["Paris", " big dog"]},
    )
    params = engine.requests[0].sampling_params
    assert params.logit_bias == {42: -100.0, 7: 3.5} and params.allowed_token_ids == [7, 9, 42]
    tok = tokenizer()
    expected = []
    for word in ("Paris", "big dog"):
        alone = tok.encode(word, add_special_tokens=False)
        spaced = tok.encode(" " + word, add_special_tokens=False)
        expected += [alone] if alone == spaced else [alone, spaced]
    assert params.bad_words_token_ids == expected


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"logit_bias": {"x1": 1}}, "logit_bias"),
        ({"logit_bias": {"49152": 1}}, "logit_bias"),  # one past the vocabulary
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": ["  "]}, "bad_words"),
        ({"bad_words": ["w"] * 1025}, "bad_words"),
    ],
)
async def test_bad_token_filters_are_a_400_naming_the_field(extra, param):
    app, engine = make_app()
    response = await post(app, "/v1/completions", {"prompt": PROMPT, **extra})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert engine.requests == []


# ---- completions: suffix, best_of, echo, prompt_logprobs


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"suffix": "!"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"best_of": 3, "n": 2}, "best_of"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
async def test_refused_completion_parameters(extra, param):
    app, engine = make_app()
    response = await post(app, "/v1/completions", {"prompt": PROMPT, **extra})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert engine.requests == []


async def test_best_of_equal_to_n_is_served(served):
    client, engine = served
    result = await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, n=2, best_of=2)
    assert len(result.choices) == 2 and len(engine.requests) == 2


async def test_echo_puts_the_prompt_text_in_front(served):
    client, _ = served
    result = await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, echo=True)
    assert result.choices[0].text == PROMPT + script_text(3)
    ids = tokenizer().encode("Hello world", add_special_tokens=False)
    by_ids = await client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1, echo=True)
    assert by_ids.choices[0].text == "Hello world" + script_text(1)


async def test_echo_with_logprobs_puts_the_prompt_logprobs_in_front(served):
    client, engine = served
    result = await client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2, echo=True, logprobs=1
    )
    prompt_ids = engine.requests[0].prompt_token_ids
    assert engine.requests[0].sampling_params.prompt_logprobs == 1
    lp = result.choices[0].logprobs
    num_prompt = len(prompt_ids)
    assert len(lp.tokens) == num_prompt + 2
    assert "".join(lp.tokens) == result.choices[0].text
    # The first prompt token has no logprob; the others carry the engine's (-position in the fake).
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:num_prompt] == [-float(p) for p in range(1, num_prompt)]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert result.choices[0].model_extra["prompt_logprobs"] is None  # not asked for as such


async def test_streamed_echo_comes_first(served):
    client, _ = served
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=3, echo=True, stream=True
    )
    texts = [chunk.choices[0].text async for chunk in stream if chunk.choices]
    assert texts[0].startswith(PROMPT) and "".join(texts) == PROMPT + script_text(3)


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_with_max_tokens_0_answers_the_prompt_alone(served, stream):
    client, engine = served
    kwargs = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
    if stream:
        chunks = [c async for c in await client.completions.create(stream=True, **kwargs) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
        finish = chunks[-1].choices[0].finish_reason
    else:
        result = await client.completions.create(**kwargs)
        [choice] = result.choices
        text, tokens, finish = choice.text, choice.logprobs.tokens, choice.finish_reason
        assert result.usage.completion_tokens == 0
    # The engine runs the prompt for one token (its logprobs come with that pass): never shown.
    [request] = engine.requests
    assert request.sampling_params.max_tokens == 1 and request.sampling_params.prompt_logprobs == 1
    assert (text, finish) == (PROMPT, "length")
    assert len(tokens) == len(request.prompt_token_ids) and "".join(tokens) == PROMPT


async def test_max_tokens_0_needs_echo_and_no_min_tokens(served):
    client, engine = served
    for extra, param in (
        ({"echo": False}, "max_tokens"),
        ({"echo": True, "extra_body": {"min_tokens": 1}}, "min_tokens"),
    ):
        with pytest.raises(openai.BadRequestError) as error:
            await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, **extra)
        assert error.value.body["param"] == param
    assert engine.requests == []


async def test_prompt_logprobs_over_http(served):
    client, engine = served
    result = await client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    prompt_ids = engine.requests[0].prompt_token_ids
    shown = result.choices[0].model_extra["prompt_logprobs"]
    assert len(shown) == len(prompt_ids) and shown[0] is None
    for position, (token_id, entry) in enumerate(zip(prompt_ids[1:], shown[1:]), 1):
        assert entry[str(token_id)]["logprob"] == -position and entry[str(token_id)]["rank"] == position
        assert len(entry) <= 3 and entry[str(token_id)]["decoded_token"] == tokenizer().decode([token_id])


# ---- streaming usage


async def test_continuous_usage_stats_put_usage_on_every_chunk(served):
    client, _ = served
    stream = await client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = [chunk async for chunk in stream]
    assert all(chunk.usage is not None for chunk in chunks)
    *per_token, final = chunks
    assert final.choices == [] and final.usage.completion_tokens == 4
    counts = [c.usage.completion_tokens for c in per_token]
    assert counts == sorted(counts) and counts[-1] == 4
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)


async def test_chat_continuous_usage_includes_the_role_chunk(served):
    client, _ = served
    stream = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = [chunk async for chunk in stream]
    assert all(chunk.usage is not None for chunk in chunks)
    assert chunks[0].usage.completion_tokens == 0 and chunks[-1].usage.completion_tokens == 3


async def test_continuous_usage_needs_include_usage(served):
    client, _ = served
    stream = await client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=2,
        stream=True,
        stream_options={"continuous_usage_stats": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks and all(chunk.usage is None for chunk in chunks)


async def test_force_include_usage_ends_every_stream_with_usage():
    app, _ = make_app(options=APIOptions(enable_force_include_usage=True))
    client = openai_client(app)
    stream = await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, stream=True)
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    assert all(chunk.usage is None for chunk in chunks[:-1])


# ---- errors: the engine's fault is a 500, the request's a 400


@pytest.mark.parametrize("internal, status", [(True, 500), (False, 400)])
async def test_engine_errors_are_500_and_input_errors_400(internal, status):
    engine = FakeEngineClient()
    engine.fail_with, engine.fail_internally = "the grammar refused token 7", internal
    app, _ = make_app(engine)
    client = openai_client(app)
    error_type = openai.InternalServerError if internal else openai.BadRequestError
    with pytest.raises(error_type) as info:
        await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == status and "grammar refused" in info.value.message
    stream = await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, stream=True)
    with pytest.raises(openai.APIError) as streamed:
        [chunk async for chunk in stream]
    assert "grammar refused" in streamed.value.message


async def test_stream_error_event_carries_the_status():
    engine = FakeEngineClient()
    engine.fail_with, engine.fail_internally = "worker failed", True
    app, _ = make_app(engine)
    response = await post(app, "/v1/completions", {"prompt": PROMPT, "stream": True})
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == 500


# ---- n > 1: cached_tokens is the request's own hit


async def test_cached_tokens_for_n_siblings_is_the_requests_own_hit(served):
    client, engine = served
    # Child 0 found 16 tokens; its siblings then also found the block child 0 computed.
    engine.cached_tokens_by_index = {0: 16, 1: 32, 2: 32}
    result = await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, n=3)
    assert result.usage.prompt_tokens_details.cached_tokens == 16


# ---- aborts: one per request


async def test_a_stop_string_aborts_once(served):
    client, engine = served
    result = await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, stop=["quick"])
    assert result.choices[0].text == "Hello world! The "
    assert engine.num_aborts == 1 and engine.aborted == {engine.requests[0].request_id}


def test_serve_flags_set_the_api_options():
    args = build_parser().parse_args(["--allow-unknown-fields", "--enable-force-include-usage"])
    assert api_options(args) == APIOptions(allow_unknown_fields=True, enable_force_include_usage=True)
    assert api_options(build_parser().parse_args([])) == APIOptions()
