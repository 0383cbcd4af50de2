"""Request parameters end to end: ``weft serve`` on the real default model, the official client.

The session's shared server (``default_server``: one local engine core). Outputs are greedy, so a
first request learns what the model says and the next ones check how a
parameter changes it, as vLLM documents: a stop token's or EOS's text is
left out of ``text`` (its id still counted) unless
``include_stop_str_in_output``; ``min_tokens`` holds EOS back; logit_bias,
allowed_token_ids and bad_words steer the sampler; echo and
prompt_logprobs show the prompt; continuous_usage_stats puts usage on
every chunk; an unknown field is a 400 naming it.
"""

from __future__ import annotations

import math

import openai
import pytest

from services.api.tokenizer import Tokenizer
from services.model_files import resolve

pytestmark = pytest.mark.slow

MODEL = resolve(None)
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(MODEL.hf_dir)


@pytest.fixture(scope="module")
def greedy(client):
    """The model's greedy continuation of PROMPT: (text, token ids)."""
    result = client.completions.create(
        model=_model(client),
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    return result.choices[0].text, result.choices[0].logprobs.tokens


def _model(client) -> str:
    return client.models.list().data[0].id


def complete(client, **kwargs):
    extra = kwargs.pop("extra_body", {})
    return client.completions.create(
        model=_model(client), prompt=PROMPT, temperature=0.0, extra_body=extra, **kwargs
    )


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_ends_the_text_before_its_own(client, tokenizer, include):
    ids = tokenizer.encode(
        complete(client, max_tokens=8, extra_body={"ignore_eos": True}).choices[0].text,
        add_special_tokens=False,
    )
    stop_id = ids[2]
    result = complete(
        client,
        max_tokens=8,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id], "include_stop_str_in_output": include},
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop_id
    first = ids.index(stop_id)
    assert choice.text == tokenizer.decode(ids[: first + 1] if include else ids[:first])
    assert result.usage.completion_tokens == first + 1  # the stop token is counted


@pytest.mark.parametrize("include", [False, True])
def test_eos_text_is_left_out_unless_included(client, tokenizer, include):
    # min_tokens holds EOS back for two tokens; then a +100 bias makes it certain.
    eos = tokenizer.eos_token_id
    result = complete(
        client,
        max_tokens=10,
        logit_bias={str(eos): 100},
        extra_body={"min_tokens": 2, "skip_special_tokens": False, "include_stop_str_in_output": include},
    )
    choice = result.choices[0]
    eos_text = tokenizer.decode([eos], skip_special_tokens=False)
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] is None
    assert result.usage.completion_tokens == 3
    assert (eos_text in choice.text) == include and choice.text.endswith(eos_text) == include


def test_allowed_token_ids_and_logit_bias_steer_every_token(client, tokenizer):
    allowed = tokenizer.encode(" yes no", add_special_tokens=False)
    result = complete(
        client, max_tokens=6, logprobs=0, extra_body={"allowed_token_ids": allowed, "ignore_eos": True}
    )
    assert set(tokenizer.encode(result.choices[0].text, add_special_tokens=False)) <= set(allowed)
    biased = complete(
        client, max_tokens=4, logit_bias={str(allowed[1]): 100}, extra_body={"ignore_eos": True}
    )
    assert biased.choices[0].text == tokenizer.decode([allowed[1]] * 4)


def test_bad_words_never_appear(client, greedy):
    text, pieces = greedy
    word = next(p.strip() for p in pieces if p.strip().isalpha())
    result = complete(client, max_tokens=8, extra_body={"bad_words": [word], "ignore_eos": True})
    assert word in text and word not in result.choices[0].text


def test_echo_with_logprobs_puts_the_prompt_first(client, tokenizer, greedy):
    result = complete(client, max_tokens=3, echo=True, logprobs=1, extra_body={"ignore_eos": True})
    choice = result.choices[0]
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert choice.text.startswith(PROMPT) and choice.text[len(PROMPT) :] == _first_tokens_text(greedy, 3)
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 3 and "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and all(v <= 0 and math.isfinite(v) for v in lp.token_logprobs[1:])


def test_prompt_logprobs_over_http(client, tokenizer):
    result = complete(client, max_tokens=1, extra_body={"prompt_logprobs": 2})
    shown = result.choices[0].model_extra["prompt_logprobs"]
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert len(shown) == len(prompt_ids) and shown[0] is None
    for token_id, entry in zip(prompt_ids[1:], shown[1:]):
        assert str(token_id) in entry and entry[str(token_id)]["logprob"] <= 0


def test_continuous_usage_stats_on_every_chunk(client):
    stream = complete(
        client,
        max_tokens=4,
        stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = list(stream)
    assert chunks and all(chunk.usage is not None for chunk in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    counts = [chunk.usage.completion_tokens for chunk in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == 4


def test_unknown_fields_and_refused_ones_are_a_400(client):
    with pytest.raises(openai.BadRequestError) as unknown:
        complete(client, max_tokens=2, extra_body={"temprature": 0.3})
    assert "temprature" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as suffix:
        complete(client, max_tokens=2, suffix="!")
    assert "suffix" in suffix.value.message
    with pytest.raises(openai.BadRequestError) as options:
        complete(client, max_tokens=2, stream_options={"include_usage": True})
    assert "stream_options" in options.value.message


def _first_tokens_text(greedy, n: int) -> str:
    return "".join(greedy[1][:n])


def test_echo_with_max_tokens_0_answers_the_prompt_alone(client, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    result = complete(client, max_tokens=0, echo=True)
    [choice] = result.choices
    assert (choice.text, choice.finish_reason, choice.logprobs) == (PROMPT, "length", None)
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(prompt_ids), 0)
    chunks = list(complete(client, max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    with pytest.raises(openai.BadRequestError) as error:  # without echo there is nothing to answer
        complete(client, max_tokens=0)
    assert error.value.body["param"] == "max_tokens"


def test_echo_with_max_tokens_0_shows_the_prompt_logprobs(client, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    choice = complete(client, max_tokens=0, echo=True, logprobs=2).choices[0]
    lp = choice.logprobs
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(lp.tokens) == len(prompt_ids) and "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # The same numbers vLLM's prompt_logprobs give for the prompt's own tokens.
    shown = (
        complete(client, max_tokens=1, extra_body={"prompt_logprobs": 2})
        .choices[0]
        .model_extra["prompt_logprobs"]
    )
    for token_id, value, top, entry in zip(
        prompt_ids[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], shown[1:]
    ):
        assert value == pytest.approx(entry[str(token_id)]["logprob"], abs=1e-4)
        assert 2 <= len(top) <= 3  # the top 2, and the prompt's token when it is not among them


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_spaces_between_special_tokens_is_honoured(client, tokenizer, endpoint):
    # Only special tokens may be sampled, so they follow one another. SmolLM2's decoder
    # (byte-level) puts no space between tokens, so both settings show them joined.
    specials = tokenizer.encode("<|im_start|><|im_end|>", add_special_tokens=False)
    texts = []
    for spaces in (True, False):
        extra = {
            "allowed_token_ids": specials,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": spaces,
        }
        if endpoint == "chat":
            result = client.chat.completions.create(
                model=_model(client),
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=4,
                temperature=0.0,
                extra_body=extra,
            )
            texts.append(result.choices[0].message.content)
        else:
            texts.append(complete(client, max_tokens=4, extra_body=extra).choices[0].text)
    ids = tokenizer.encode(texts[0], add_special_tokens=False)
    assert len(ids) == 4 and set(ids) <= set(specials) and " " not in texts[0]
    assert texts[1] == texts[0] == tokenizer.decode(ids, skip_special_tokens=False)
