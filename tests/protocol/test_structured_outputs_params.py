"""StructuredOutputsParams and the structured-output fields on the wire."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from protocol import CachedRequestData, SamplingParams, SchedulerOutput, StructuredOutputsParams
from protocol.codec import DecodeError, Decoder, Encoder


@pytest.mark.parametrize(
    "kwargs, kind",
    [
        ({"choice": ["yes", "no"]}, "choice"),
        ({"regex": r"\d+"}, "regex"),
        ({"json": {"type": "object"}}, "json"),
        ({"json": '{"type": "string"}'}, "json"),
        ({"json_object": True}, "json_object"),
        ({"grammar": 'root ::= "a"'}, "grammar"),
    ],
)
def test_each_kind(kwargs, kind):
    assert StructuredOutputsParams(**kwargs).kind == kind


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of choice, regex, json, json_object, grammar; got none"),
        ({"regex": "a", "choice": ["a"]}, "got choice, regex"),
        ({"json_object": True, "grammar": 'root ::= "a"'}, "got json_object, grammar"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": ["a", ""]}, "choice must be a non-empty list of non-empty strings"),
        ({"regex": "  "}, "regex must be a non-empty string"),
        ({"grammar": ""}, "grammar must be a non-empty string"),
        ({"json": "{nope"}, "json must be a JSON schema; its text is not valid JSON"),
        ({"json": "[1, 2]"}, "json must be a JSON schema: an object"),
    ],
)
def test_bad_params_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        StructuredOutputsParams(**kwargs)


def test_a_schema_dict_is_kept_as_its_json_text_and_keys_the_cache():
    params = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert json.loads(params.json) == {"type": "object", "properties": {"a": {"type": "integer"}}}
    same = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert params.cache_key == same.cache_key == ("json", params.json, False)
    compact = StructuredOutputsParams(json=params.json, disable_any_whitespace=True)
    assert compact.cache_key != params.cache_key
    # Whitespace does not matter outside JSON: it does not split the cache.
    assert StructuredOutputsParams(regex="a", disable_any_whitespace=True).cache_key == ("regex", "a", False)
    assert StructuredOutputsParams(choice=["a", "b"]).spec == '["a", "b"]'


def test_sampling_params_carry_them_through_the_codec():
    params = SamplingParams(
        temperature=0, structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"])
    )
    decoded = Decoder(SamplingParams).decode(Encoder().encode(params))
    assert decoded == params and decoded.structured_outputs.kind == "choice"


def test_invalid_params_are_refused_on_decode():
    body = msgspec.msgpack.encode({"structured_outputs": {"regex": "a", "grammar": "b"}})
    with pytest.raises(DecodeError, match="exactly one of"):
        Decoder(SamplingParams).decode([body])


def test_the_grammar_bitmask_travels_as_a_raw_frame():
    bitmask = np.arange(3 * 1536, dtype=np.int32).reshape(3, 1536)
    output = SchedulerOutput(
        [],
        CachedRequestData(),
        {"a": 1, "b": 2},
        3,
        structured_output_request_ids=["b", "a"],
        grammar_bitmask=bitmask,
    )
    frames = Encoder().encode(output)
    assert len(frames) == 2 and len(frames[1]) == bitmask.nbytes  # out of band, not pickled
    decoded = Decoder(SchedulerOutput).decode(frames)
    assert decoded.structured_output_request_ids == ["b", "a"]
    np.testing.assert_array_equal(decoded.grammar_bitmask, bitmask)
    plain = Decoder(SchedulerOutput).decode(Encoder().encode(SchedulerOutput([], CachedRequestData(), {}, 0)))
    assert plain.grammar_bitmask is None and plain.structured_output_request_ids == []
