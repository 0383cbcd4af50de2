"""SamplingParams: every bad field is refused by name; good ones round-trip."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from protocol import SamplingParams, SamplingType
from protocol.codec import DecodeError, Decoder, Encoder

INVALID = [
    ({"temperature": -0.1}, "temperature"),
    ({"logit_bias": {5: 100.5}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -4}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"min_p": -0.5}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"logprobs": -2}, "logprobs"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
]


def _ids(case: Any) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items()) if isinstance(case, dict) else str(case)


@pytest.mark.parametrize("kwargs, field", INVALID, ids=_ids)
def test_invalid_field_raises_value_error_naming_it(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", INVALID, ids=_ids)
def test_invalid_field_is_refused_on_decode(kwargs: dict[str, Any], field: str) -> None:
    body = msgspec.msgpack.encode(kwargs)
    with pytest.raises(DecodeError, match=rf"message: {field} must be"):
        Decoder(SamplingParams).decode([body])


VALID = [
    {},
    {
        "logit_bias": {5: -100.0, 6: 100.0},
        "allowed_token_ids": [5, 6],
        "bad_words": ["no"],
        "bad_words_token_ids": [[1, 2], [3]],
    },
    {"temperature": 0.0, "max_tokens": 1},
    {"temperature": 1.3, "top_p": 1.0, "top_k": -1, "min_p": 1.0, "seed": 0},
    {"n": 4, "top_p": 0.01, "top_k": 50, "min_tokens": 16, "max_tokens": 16},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 1.2},
    {"max_tokens": None, "ignore_eos": True, "logprobs": -1, "prompt_logprobs": 0},
    {"stop": ["</s>", "\n"], "stop_token_ids": [0, 2], "include_stop_str_in_output": True},
    {"skip_special_tokens": False, "logprobs": 5},
]


@pytest.mark.parametrize("kwargs", VALID, ids=_ids)
def test_valid_params_round_trip(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    assert Decoder(SamplingParams).decode(Encoder().encode(params)) == params
    assert msgspec.json.decode(msgspec.json.encode(params), type=SamplingParams) == params


def test_defaults_are_omitted_on_the_wire() -> None:
    assert msgspec.msgpack.decode(Encoder().encode(SamplingParams())[0]) == {}


def test_a_single_stop_string_becomes_a_list() -> None:
    params = SamplingParams(stop="END")
    assert params.stop == ["END"] and params.stop_strings == ["END"]


@pytest.mark.parametrize(
    "kwargs, kind",
    [
        ({"temperature": 0.0}, SamplingType.GREEDY),
        ({"temperature": 1e-6, "seed": 3}, SamplingType.GREEDY),
        ({"temperature": 0.8}, SamplingType.RANDOM),
        ({"temperature": 0.8, "seed": 3}, SamplingType.RANDOM_SEED),
    ],
    ids=_ids,
)
def test_sampling_type(kwargs: dict[str, Any], kind: SamplingType) -> None:
    params = SamplingParams(**kwargs)
    assert params.sampling_type == kind
    assert params.is_greedy == (kind == SamplingType.GREEDY)
