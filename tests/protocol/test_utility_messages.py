"""Utility calls on the wire, and the fields appended for the request metrics."""

from __future__ import annotations

import msgspec
import pytest

from protocol import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from protocol.codec import DecodeError, Decoder, Encoder
from protocol.engine import UtilityMethod, UtilityRequest, UtilityResult, has_deltas, without_deltas


def _round_trip(value, type_):
    return Decoder(type_).decode(Encoder().encode(value))


@pytest.mark.parametrize("method", list(UtilityMethod))
def test_utility_request_round_trip(method):
    assert _round_trip(UtilityRequest(7, method), UtilityRequest) == UtilityRequest(7, method)


def test_utility_result_rides_an_outputs_batch():
    batch = EngineCoreOutputs(engine_index=1, utility_output=UtilityResult(3, ok=False))
    back = _round_trip(batch, EngineCoreOutputs)
    assert back.utility_output == UtilityResult(3, ok=False) and back.outputs == []


def test_an_unknown_method_is_refused_by_the_decoder():
    with pytest.raises(DecodeError):
        Decoder(UtilityRequest).decode([msgspec.msgpack.encode([1, "sleep"])])


def test_outputs_without_the_appended_fields_still_decode():
    # An output as encoded before `timestamp` and `engine_index` existed: trailing defaults.
    old = msgspec.msgpack.encode(["r", [1, 2]])
    output = msgspec.msgpack.Decoder(EngineCoreOutput).decode(old)
    assert (output.timestamp, output.engine_index) == (0.0, 0)
    stamped = EngineCoreOutput("r", [1], timestamp=12.5, engine_index=2)
    assert _round_trip(stamped, EngineCoreOutput) == stamped


def test_deltas_are_what_a_heartbeat_may_not_repeat():
    stats = SchedulerStats(
        num_running_reqs=2,
        prefix_cache_hits=16,
        iteration_tokens_counts=[0, 1],
        iteration_tokens_sum=8,
        spec_decode_num_accepted_tokens_per_pos=[1],
    )
    assert has_deltas(stats) and not has_deltas(without_deltas(stats))
    assert without_deltas(stats).num_running_reqs == 2
