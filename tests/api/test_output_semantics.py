"""vLLM V1's output semantics in the front end's RequestState, with the real tokenizer.

The expected texts are vLLM's: ``tests/detokenizer/test_min_tokens.py``
(min_tokens with a stop string; this tokenizer splits the sentence as
OPT's does, so the truths carry over) and its detokenizer's rule that a
stop token or EOS ends the request with its id in ``token_ids`` but not
its text in ``text``, unless ``include_stop_str_in_output``.
"""

from __future__ import annotations

import pytest

from protocol import EngineCoreOutput, FinishReason, SamplingParams
from services.api.output_processor import RequestState
from tests.api.fake_engine_client import tokenizer

SENTENCE = "Hello, my name is Lee, and I'm a student in the college of engineering"


def run(
    params: SamplingParams, token_ids: list[int], last: EngineCoreOutput | None = None, eos: int | None = None
) -> RequestState:
    """Feed ``token_ids`` one output each (then ``last``) until a stop string ends it."""
    state = RequestState.create("r", params, tokenizer(), eos)
    for token_id in token_ids:
        if state.process(EngineCoreOutput("r", [token_id])):
            return state
    if last is not None:
        state.process(last)
    return state


@pytest.mark.parametrize(
    "min_tokens, stop, truth",
    [
        (0, None, " is Lee, and I'm a student in the college of engineering"),
        (0, "e", " is L"),
        (5, "e", " is Lee, and I'm a stud"),
    ],
)
def test_min_tokens_holds_back_stop_strings(min_tokens, stop, truth):
    ids = tokenizer().encode(SENTENCE, add_special_tokens=False)[4:]  # after "Hello, my name"
    state = run(SamplingParams(min_tokens=min_tokens, stop=stop, max_tokens=100), ids)
    assert state.text == truth
    assert (state.finish_reason, state.stop_reason) == (("stop", stop) if stop else (None, None))


def test_streamed_text_with_min_tokens_is_the_whole_text_in_pieces():
    ids = tokenizer().encode(SENTENCE, add_special_tokens=False)[4:]
    state = RequestState.create("r", SamplingParams(min_tokens=5, stop="e", max_tokens=100), tokenizer())
    pieces = []
    for token_id in ids:
        stopped = state.process(EngineCoreOutput("r", [token_id]))
        pieces.append(state.detokenizer.take_delta(stopped))
        if stopped:
            break
    assert "".join(pieces) == " is Lee, and I'm a stud"


@pytest.mark.parametrize("include", [False, True])
def test_eos_ends_the_request_without_its_text(include):
    tok = tokenizer()
    eos = tok.eos_token_id
    ids = tok.encode(" Paris.", add_special_tokens=False)
    last = EngineCoreOutput("r", [eos], finish_reason=FinishReason.STOP)
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include, max_tokens=10)
    state = run(params, ids, last, eos=eos)
    eos_text = tok.decode([eos], skip_special_tokens=False)
    assert state.text == " Paris." + (eos_text if include else "")
    assert state.token_ids == ids + [eos] and state.stop_reason is None


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_ends_the_request_without_its_text(include):
    tok = tokenizer()
    ids = tok.encode(" The capital", add_special_tokens=False)
    stop_id = tok.encode(" city", add_special_tokens=False)[0]
    last = EngineCoreOutput("r", [stop_id], finish_reason=FinishReason.STOP, stop_reason=stop_id)
    params = SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=include, max_tokens=10)
    state = run(params, ids, last)
    assert state.text == " The capital" + (" city" if include else "")
    assert state.token_ids[-1] == stop_id and state.stop_reason == stop_id


def test_a_length_finish_keeps_its_last_tokens_text():
    tok = tokenizer()
    ids = tok.encode(" one two", add_special_tokens=False)
    last = EngineCoreOutput(
        "r", [tok.encode(" three", add_special_tokens=False)[0]], finish_reason=FinishReason.LENGTH
    )
    assert run(SamplingParams(max_tokens=10), ids, last).text == " one two three"


def test_a_stop_string_is_left_out_unless_included():
    ids = tokenizer().encode(" red, green, blue", add_special_tokens=False)
    assert run(SamplingParams(stop=", g", max_tokens=10), ids).text == " red"
    included = SamplingParams(stop=", g", include_stop_str_in_output=True, max_tokens=10)
    assert run(included, ids).text == " red, g"
