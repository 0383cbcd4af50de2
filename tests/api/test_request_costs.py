"""What one request may cost the API process (issue 44, items 2 and 5), on the in-process app.

The attacks: a 256 KiB body of 64 prompts x 64 bad words of 4 KB held /version for 8 s,
since each prompt built (and tokenized) its sampling parameters again on the event loop;
n=8 x a 701-token prompt x prompt_logprobs=20 returned 9.3 MiB, each choice computing the
prompt's logprobs again. Now: parameters are built once, off the loop; the filters are
capped; prompt logprobs are computed once a prompt, budgeted and converted off the loop.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.api import serving
from services.api.limits import ServingLimits
from services.api.output_processor import RequestState
from tests.api.fake_engine_client import http_client, make_app, tokenizer
from tests.polling import wait_until

COMPLETIONS = "/v1/completions"


def _error(response, status: int, param: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


async def test_sampling_parameters_are_built_once_and_off_the_loop(monkeypatch):
    app, engine = make_app()
    client = http_client(app)
    loop_thread = threading.get_ident()
    calls: list[int] = []  # the thread of each build
    version_answered = threading.Event()
    build = serving.make_sampling_params

    def blocking_build(*args, **kwargs):
        calls.append(threading.get_ident())
        # Held until /version has answered: on the loop, that could never happen.
        assert version_answered.wait(30), "/version did not answer while the request was built"
        return build(*args, **kwargs)

    monkeypatch.setattr(serving, "make_sampling_params", blocking_build)
    encoded: list[int] = []
    encode_batch = type(tokenizer()).encode_batch

    def counting_encode_batch(self, texts, add_special_tokens=True):
        encoded.append(len(texts))
        return encode_batch(self, texts, add_special_tokens)

    monkeypatch.setattr(type(tokenizer()), "encode_batch", counting_encode_batch)
    bad_words = [f"b{i}" for i in range(32)]
    body = {"prompt": [f"prompt {i}" for i in range(64)], "max_tokens": 1, "bad_words": bad_words}
    big = asyncio.ensure_future(client.post(COMPLETIONS, json=body, timeout=60))
    await wait_until(lambda: calls or big.done(), 30, "the request's parameters to be built")
    assert (await client.get("/version")).status_code == 200
    version_answered.set()
    response = await big
    assert response.status_code == 200, response.text
    assert len(calls) == 1 and calls[0] != loop_thread  # once for 64 prompts, not on the loop
    assert encoded == [32, 32]  # each bad word tokenized once a spelling, for the whole request
    assert len(engine.requests) == 64
    assert len({id(r.sampling_params.bad_words_token_ids) for r in engine.requests}) == 1
    # The attack's own body (64 bad words of 4 KB) comes to far more tokens than a prompt may hold.
    attack = {**body, "bad_words": [f"w{i} " + "x" * 4000 for i in range(64)]}
    message = _error(await client.post(COMPLETIONS, json=attack), 400, "bad_words")
    assert "--max-prompt-tokens" in message and len(calls) == 2


async def test_token_filters_are_capped():
    app, engine = make_app(limits=ServingLimits(max_prompt_chars=1000, max_prompt_tokens=100))
    client = http_client(app)
    vocab = tokenizer().vocab_size

    async def complete(**extra):
        return await client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1, **extra})

    message = _error(await complete(logit_bias={str(i): 1 for i in range(301)}), 400, "logit_bias")
    assert "300" in message
    assert (await complete(logit_bias={str(i): 1 for i in range(300)})).status_code == 200
    too_many = list(range(vocab)) + [0]
    assert "vocabulary" in _error(await complete(allowed_token_ids=too_many), 400, "allowed_token_ids")
    # Bad words count in the text limit (before tokenizing) and the token limit.
    assert "--max-prompt-chars" in _error(await complete(bad_words=["x" * 1001]), 400, "bad_words")
    many_tokens = [" ".join(f"w{i}" for i in range(150))]
    assert "tokens" in _error(await complete(bad_words=many_tokens), 400, "bad_words")
    assert len(engine.requests) == 1


async def test_prompt_logprobs_are_computed_once_a_prompt_and_budgeted(monkeypatch):
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    num_tokens = len(tokenizer().encode(prompt))
    # Room for exactly n=4 x the prompt x (2 + 1).
    app, engine = make_app(limits=ServingLimits(max_prompt_logprob_entries=4 * num_tokens * 3))
    client = http_client(app)
    threads: list[int] = []
    add = RequestState.add_prompt_logprobs

    def recording_add(self, entries):
        threads.append(threading.get_ident())
        return add(self, entries)

    monkeypatch.setattr(RequestState, "add_prompt_logprobs", recording_add)
    body = {"prompt": prompt, "max_tokens": 2, "n": 4, "prompt_logprobs": 2, "seed": 1}
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    asked = [r.sampling_params.prompt_logprobs for r in engine.requests]
    assert asked == [2, None, None, None]  # one engine request computes them, for all four
    shown = [c["prompt_logprobs"] for c in response.json()["choices"]]
    assert len(shown[0]) == num_tokens and shown[0][0] is None
    assert all(s == shown[0] for s in shown)
    assert threads and threading.get_ident() not in threads  # converted off the loop
    # n x prompt tokens x (k + 1) past the budget is refused before any engine work.
    for over in ({**body, "prompt_logprobs": 3}, {**body, "n": 5}, {**body, "prompt": [prompt, "Hi"]}):
        message = _error(await client.post(COMPLETIONS, json=over), 400, "prompt_logprobs")
        assert "--max-prompt-logprob-entries" in message
    assert len(engine.requests) == 4


@pytest.mark.parametrize("stream", [False, True])
async def test_echoed_logprobs_show_the_prompt_for_every_choice(stream):
    """Echo with logprobs shows the prompt's entries in front of every choice's, shared or not."""
    app, engine = make_app()
    client = http_client(app)
    body = {"prompt": "Hello there you", "max_tokens": 2, "n": 3, "echo": True, "logprobs": 1}
    response = await client.post(COMPLETIONS, json={**body, "stream": stream, "seed": 3})
    assert response.status_code == 200
    if stream:
        assert all(r.sampling_params.prompt_logprobs == 1 for r in engine.requests)
        return
    choices = response.json()["choices"]
    num_prompt = len(tokenizer().encode("Hello there you"))
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [num_prompt + 2] * 3
    assert [c["logprobs"]["token_logprobs"][0] for c in choices] == [None] * 3
