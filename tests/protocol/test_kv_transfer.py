"""The KV transfer wire: new fields travel and default away, blocks go as raw frames."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from protocol import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreRequest,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from protocol.codec import DecodeError, Decoder, Encoder
from protocol.kv_transfer import (
    KVBlock,
    KVBlockTransfer,
    KVConnectorMetadata,
    KVGet,
    KVPut,
    KVServiceReply,
    KVServiceRequest,
    KVTransferParams,
)


def roundtrip(obj, type_):
    return Decoder(type_).decode(Encoder().encode(obj))


def test_requests_and_outputs_carry_transfer_params():
    params = KVTransferParams(do_remote_prefill=True, remote_num_tokens=64)
    request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(), 0.0, kv_transfer_params=params)
    assert roundtrip(request, EngineCoreRequest).kv_transfer_params == params
    output = EngineCoreOutput("r", [4], kv_transfer_params=params)
    assert roundtrip(output, EngineCoreOutput).kv_transfer_params == params
    # Absent, they are one msgpack nil at the end of the array, and decode to None.
    plain = EngineCoreRequest("r", [1], SamplingParams(), 0.0)
    assert msgspec.msgpack.decode(Encoder().encode(plain)[0])[-1] is None
    assert roundtrip(plain, EngineCoreRequest).kv_transfer_params is None


def test_params_from_other_connectors_are_ignored_not_refused():
    raw = msgspec.json.encode({"do_remote_decode": True, "remote_engine_id": "x", "remote_block_ids": [1]})
    assert msgspec.json.decode(raw, type=KVTransferParams) == KVTransferParams(do_remote_decode=True)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"remote_num_tokens": -1}', type=KVTransferParams)


def test_the_step_plan_and_the_reports_travel():
    plan = KVConnectorMetadata(
        loads=[KVBlockTransfer("d", [3, 4], [b"a" * 32, b"b" * 32], 2.0)],
        saves=[KVBlockTransfer("p", [5], [b"c" * 32])],
    )
    output = SchedulerOutput([], CachedRequestData(), {}, 0, kv_connector_metadata=plan)
    assert roundtrip(output, SchedulerOutput).kv_connector_metadata == plan
    report = ModelRunnerOutput(finished_sending=["p"], finished_recving={"d": 1})
    got = roundtrip(report, ModelRunnerOutput)
    assert (got.finished_sending, got.finished_recving) == (["p"], {"d": 1})


def test_service_messages_decode_by_tag_with_blocks_as_frames():
    data = np.arange(4096, dtype=np.uint8)
    put = KVPut(7, [KVBlock(b"k", "float32", [1024], 123, data)])
    frames = Encoder().encode(put)
    assert len(frames) == 2 and bytes(frames[1]) == data.tobytes()  # the bytes travel as their own frame
    got = Decoder(KVServiceRequest).decode(frames)
    assert isinstance(got, KVPut) and np.array_equal(got.blocks[0].data, data)
    assert isinstance(roundtrip(KVGet(8, [b"k"], 50), KVServiceRequest), KVGet)
    with pytest.raises(DecodeError):
        Decoder(KVServiceReply).decode(Encoder().encode(KVGet(9, [])))  # a request is not a reply
