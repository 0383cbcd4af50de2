"""The app through the official openai client, against the fake engine."""

from __future__ import annotations

import openai
import pytest

from tests.api.fake_engine_client import (
    MODEL_NAME,
    SCRIPT,
    FakeEngineClient,
    make_app,
    openai_client,
    tokenizer,
)


@pytest.fixture
def served():
    app, engine = make_app()
    return openai_client(app), engine


def script_text(num_tokens: int, seed: int = 0) -> str:
    ids = tokenizer().encode(SCRIPT, add_special_tokens=False)
    return tokenizer().decode([ids[(i + seed) % len(ids)] for i in range(num_tokens)])


async def test_completion(served):
    client, engine = served
    result = await client.completions.create(model=MODEL_NAME, prompt="Say hello", max_tokens=5)
    assert result.id.startswith("cmpl-") and len(result.id) == len("cmpl-") + 32
    assert result.object == "text_completion" and result.model == MODEL_NAME
    [choice] = result.choices
    assert choice.text == script_text(5) and choice.finish_reason == "length"
    prompt_len = len(tokenizer().encode("Say hello"))
    assert result.usage.prompt_tokens == prompt_len
    assert result.usage.completion_tokens == 5 and result.usage.total_tokens == prompt_len + 5
    assert result.usage.prompt_tokens_details.cached_tokens == 0
    [request] = engine.requests
    assert request.prompt_token_ids == tokenizer().encode("Say hello")
    assert request.sampling_params.max_tokens == 5 and request.eos_token_id == tokenizer().eos_token_id


async def test_completion_defaults_to_16_tokens_and_takes_token_prompts(served):
    client, engine = served
    result = await client.completions.create(model=MODEL_NAME, prompt=[[1, 2, 3], [4, 5]])
    assert [c.index for c in result.choices] == [0, 1]
    assert all(len(tokenizer().encode(c.text, add_special_tokens=False)) > 0 for c in result.choices)
    assert [r.prompt_token_ids for r in engine.requests] == [[1, 2, 3], [4, 5]]
    assert all(r.sampling_params.max_tokens == 16 for r in engine.requests)
    assert result.usage.prompt_tokens == 5 and result.usage.completion_tokens == 32


async def test_completion_stream_with_usage(served):
    client, _ = served
    stream = await client.completions.create(
        model=MODEL_NAME, prompt="Hi", max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert all(c.object == "text_completion" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == script_text(6)
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 6


@pytest.mark.parametrize("stop", [None, "fox"])
async def test_stream_when_engine_outputs_arrive_in_a_burst(stop):
    # The front end processes every output before the stream shows the first:
    # the finish must still come once, on the last chunk.
    engine = FakeEngineClient()
    engine.burst = True
    app, _ = make_app(engine)
    stream = await openai_client(app).completions.create(
        model=MODEL_NAME, prompt="Hi", max_tokens=8, stream=True, stop=stop
    )
    chunks = [c async for c in stream]
    assert [c.choices[0].finish_reason for c in chunks][-1] == ("length" if stop is None else "stop")
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1
    expected = script_text(8) if stop is None else script_text(8).split("fox")[0]
    assert "".join(c.choices[0].text for c in chunks) == expected


async def test_chat_completion(served):
    client, engine = served
    messages = [{"role": "user", "content": "What is 2+2?"}]
    result = await client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4)
    assert result.id.startswith("chatcmpl-") and result.object == "chat.completion"
    [choice] = result.choices
    assert choice.message.role == "assistant" and choice.message.content == script_text(4)
    expected_prompt = tokenizer().encode(tokenizer().apply_chat_template(messages), add_special_tokens=False)
    assert engine.requests[0].prompt_token_ids == expected_prompt
    assert result.usage.prompt_tokens == len(expected_prompt)


async def test_chat_without_max_tokens_fills_the_context(served):
    client, engine = served
    result = await client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "x"}]
    )
    request = engine.requests[0]
    assert request.sampling_params.max_tokens == 256 - len(request.prompt_token_ids)
    assert result.usage.total_tokens == 256 and result.choices[0].finish_reason == "length"


async def test_chat_stream_n2_roles_first_and_usage(served):
    client, engine = served
    stream = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=5,
        n=2,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    texts, roles, finishes = {0: "", 1: ""}, {}, {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        roles.setdefault(choice.index, choice.delta.role)
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert finishes == {0: "length", 1: "length"}
    # Choice i runs with seed + i, which the fake engine turns into a shifted script.
    assert texts == {0: script_text(5, seed=3), 1: script_text(5, seed=4)}
    assert sorted(r.sampling_params.seed for r in engine.requests) == [3, 4]
    assert all(r.sampling_params.n == 1 for r in engine.requests)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


async def test_n2_non_streaming(served):
    client, engine = served
    result = await client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=3, n=2)
    assert [c.index for c in result.choices] == [0, 1]
    assert len(engine.requests) == 2 and len({r.request_id for r in engine.requests}) == 2
    assert result.usage.completion_tokens == 6


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_cuts_text_and_aborts(served, stream):
    client, engine = served
    kwargs = dict(model=MODEL_NAME, prompt="Hi", max_tokens=40, stop=["STOP", "never"])
    if stream:
        chunks = [c async for c in await client.completions.create(stream=True, **kwargs)]
        text = "".join(c.choices[0].text for c in chunks)
        final = chunks[-1].choices[0]
    else:
        final = (await client.completions.create(**kwargs)).choices[0]
        text = final.text
    assert text == "Hello world! The quick brown fox jumps over the lazy dog. "
    assert final.finish_reason == "stop" and final.model_extra["stop_reason"] == "STOP"
    assert engine.aborted == {engine.requests[0].request_id}


async def test_stop_string_included_when_asked(served):
    client, _ = served
    result = await client.completions.create(
        model=MODEL_NAME,
        prompt="Hi",
        max_tokens=40,
        stop="STOP",
        extra_body={"include_stop_str_in_output": True},
    )
    assert result.choices[0].text.endswith("dog. STOP")


@pytest.mark.parametrize("include", [False, True])
async def test_stop_token_id_reports_stop_reason(served, include):
    # vLLM V1: the stop token's text is left out of `text` unless
    # include_stop_str_in_output; stop_reason carries its id either way.
    client, engine = served
    stop_id = tokenizer().encode(" fox", add_special_tokens=False)[0]
    result = await client.completions.create(
        model=MODEL_NAME,
        prompt="Hi",
        max_tokens=40,
        extra_body={"stop_token_ids": [stop_id], "include_stop_str_in_output": include},
    )
    assert result.choices[0].text == "Hello world! The quick brown" + (" fox" if include else "")
    assert result.choices[0].model_extra["stop_reason"] == stop_id
    assert result.usage.completion_tokens == len(
        tokenizer().encode("Hello world! The quick brown fox", add_special_tokens=False)
    )
    assert engine.aborted == set()


async def test_completion_logprobs(served):
    client, _ = served
    result = await client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=3, logprobs=2)
    logprobs = result.choices[0].logprobs
    assert "".join(logprobs.tokens) == result.choices[0].text
    assert logprobs.token_logprobs == [-0.5] * 3
    assert logprobs.text_offset == [0, len(logprobs.tokens[0]), len(logprobs.tokens[0] + logprobs.tokens[1])]
    assert all(len(top) == 2 and top[tok] == -0.5 for top, tok in zip(logprobs.top_logprobs, logprobs.tokens))


async def test_chat_logprobs_streamed(served):
    client, _ = served
    stream = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    entries = [e async for c in stream if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 3
    assert "".join(e.token for e in entries) == script_text(3)
    for e in entries:
        assert e.logprob == -0.5 and e.bytes == list(e.token.encode())
        assert [t.logprob for t in e.top_logprobs] == [-0.5, -1.5] and e.top_logprobs[0].token == e.token


async def test_chat_content_parts_and_extras_pass_through(served):
    client, engine = served
    await client.chat.completions.create(
        model=MODEL_NAME,
        max_tokens=2,
        temperature=0.5,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        user="someone",
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ],
        extra_body={
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "ignore_eos": True,
            "min_tokens": 1,
            "skip_special_tokens": False,
            "cache_salt": "salt",
        },
    )
    request = engine.requests[0]
    params = request.sampling_params
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 5, 0.1)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.2)
    assert params.ignore_eos and params.min_tokens == 1 and not params.skip_special_tokens
    assert request.cache_salt == "salt"
    assert "ab" in tokenizer().decode(request.prompt_token_ids)


async def test_cached_tokens_reported():
    engine = FakeEngineClient()
    engine.num_cached_tokens = 16
    app, _ = make_app(engine)
    result = await openai_client(app).completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
    assert result.usage.prompt_tokens_details.cached_tokens == 16


async def test_api_key():
    app, _ = make_app(api_key="sekrit")
    result = await openai_client(app, api_key="sekrit").completions.create(
        model=MODEL_NAME, prompt="Hi", max_tokens=1
    )
    assert result.choices[0].text
    with pytest.raises(openai.AuthenticationError) as e:
        await openai_client(app, api_key="wrong").completions.create(
            model=MODEL_NAME, prompt="Hi", max_tokens=1
        )
    assert e.value.status_code == 401
