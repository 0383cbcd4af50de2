"""The wire codec: round trips of every protocol Struct, arrays as frames,
and one clean DecodeError for anything malformed."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import protocol
from protocol import (
    CacheConfig,
    CachedRequestData,
    DeviceConfig,
    EngineConfig,
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    ModelConfig,
    ModelRunnerOutput,
    NewRequestData,
    ParallelConfig,
    PoolingParams,
    PoolingType,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
    SpeculativeConfig,
    StructuredOutputsParams,
    TokenLogprobs,
)
from protocol.codec import DEFAULT_SIZE_THRESHOLD, DecodeError, Decoder, Encoder


def _logprobs(token: int) -> TokenLogprobs:
    return TokenLogprobs(token_ids=[token, 7, 9], logprobs=[-0.1, -2.5, -3.0], rank=1)


def _engine_core_request() -> EngineCoreRequest:
    params = SamplingParams(
        n=2,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=1234,
        max_tokens=32,
        min_tokens=4,
        stop=["\n\n", "END"],
        stop_token_ids=[2],
        logprobs=3,
        prompt_logprobs=1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
    )
    return EngineCoreRequest(
        request_id="req-1",
        prompt_token_ids=[1, 2, 3, 49151],
        sampling_params=params,
        arrival_time=1712.5,
        eos_token_id=2,
        priority=-3,
        cache_salt="salt",
        data_parallel_rank=1,
    )


def _engine_core_outputs() -> EngineCoreOutputs:
    finished = EngineCoreOutput(
        request_id="req-1",
        new_token_ids=[11, 12],
        new_logprobs=[_logprobs(11), _logprobs(12)],
        new_prompt_logprobs=[None, _logprobs(3)],
        finish_reason=FinishReason.STOP,
        stop_reason="END",
        num_cached_tokens=16,
        events=[EngineCoreEvent(type=EngineCoreEventType.QUEUED, timestamp=3.25)],
    )
    failed = EngineCoreOutput(
        request_id="req-2",
        new_token_ids=[],
        finish_reason=FinishReason.ERROR,
        error="prompt too long",
    )
    stats = SchedulerStats(
        num_running_reqs=3,
        num_waiting_reqs=1,
        kv_cache_usage=0.25,
        num_free_blocks=10,
        num_total_blocks=40,
        prefix_cache_queries=64,
        prefix_cache_hits=32,
        num_preemptions=1,
        step_counter=99,
    )
    return EngineCoreOutputs(
        engine_index=1,
        outputs=[finished, failed],
        scheduler_stats=stats,
        finished_requests=["req-1", "req-2"],
    )


def _scheduler_output() -> SchedulerOutput:
    new = NewRequestData(
        req_id="a",
        prompt_token_ids=[5, 6, 7],
        sampling_params=SamplingParams(temperature=0),
        block_ids=[0, 1],
        num_computed_tokens=0,
        output_token_ids=[8],
    )
    cached = CachedRequestData(req_ids=["b", "c"], new_block_ids=[[4], []], num_computed_tokens=[17, 3])
    return SchedulerOutput(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={"a": 3, "b": 1, "c": 2},
        total_num_scheduled_tokens=6,
        finished_req_ids=["z"],
        preempted_req_ids=["y"],
        scheduled_spec_decode_tokens={"c": [101]},
    )


def _model_runner_output() -> ModelRunnerOutput:
    return ModelRunnerOutput(
        req_ids=["a", "b"],
        sampled_token_ids=[[], [42, 43]],
        logprobs=[[], [_logprobs(42), _logprobs(43)]],
        prompt_logprobs={"a": [None, _logprobs(6)]},
        spec_token_ids=[[], [44, 45]],
    )


def _engine_config() -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            model="models/x.gguf",
            tokenizer="models/x.hf",
            served_model_name="x",
            dtype="bfloat16",
            max_model_len=2048,
            seed=7,
            vocab_size=49152,
            eos_token_id=2,
        ),
        cache=CacheConfig(block_size=32, enable_prefix_caching=False, kv_cache_memory=1 << 30),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, scheduling_policy="priority"),
        parallel=ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, data_parallel_rank=1),
        device=DeviceConfig(device="cuda", num_threads=2, attention_backend="triton"),
        speculative=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=5),
    )


SAMPLES = [
    _engine_core_request(),
    _engine_core_outputs(),
    _scheduler_output(),
    _model_runner_output(),
    _engine_config(),
    SamplingParams(),
    SamplingParams(
        structured_outputs=StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True)
    ),
    PoolingParams(PoolingType.MEAN, normalize=False),
]


def _round_trip(obj: Any, type_: Any, **encoder_kwargs: Any) -> Any:
    frames = Encoder(**encoder_kwargs).encode(obj)
    return Decoder(type_).decode(frames)


def _struct_types(obj: Any) -> set[type]:
    """Every Struct type reachable from ``obj``."""
    if isinstance(obj, msgspec.Struct):
        found = {type(obj)}
        for field in obj.__struct_fields__:
            found |= _struct_types(getattr(obj, field))
        return found
    if isinstance(obj, (list, tuple)):
        return set().union(*map(_struct_types, obj)) if obj else set()
    if isinstance(obj, dict):
        return _struct_types(list(obj.values()))
    return set()


@pytest.mark.parametrize("obj", SAMPLES, ids=lambda o: type(o).__name__)
def test_protocol_struct_round_trips(obj: msgspec.Struct) -> None:
    frames = Encoder().encode(obj)
    assert len(frames) == 1  # no arrays, no extra frames
    assert Decoder(type(obj)).decode(frames) == obj


def test_samples_cover_every_protocol_struct() -> None:
    exported = {
        getattr(protocol, name)
        for name in protocol.__all__
        if isinstance(getattr(protocol, name), type) and issubclass(getattr(protocol, name), msgspec.Struct)
    }
    covered = set().union(*map(_struct_types, SAMPLES))
    assert exported - covered == set()


def test_pooled_vectors_travel_as_raw_frames() -> None:
    """An embeddings request, the worker's pooled rows and the engine's per-request vectors."""
    request = EngineCoreRequest("e-0", [1, 2, 3], SamplingParams(), 0.0, pooling_params=PoolingParams())
    assert _round_trip(request, EngineCoreRequest) == request
    pooled = np.random.default_rng(0).standard_normal((2, 576), dtype=np.float32)
    runner = ModelRunnerOutput(req_ids=["a", "b"], pooled_req_ids=["b", "a"], pooled=pooled)
    frames = Encoder().encode(runner)
    assert len(frames) == 2  # the body, then the [2, 576] array as it lies in memory
    decoded = Decoder(ModelRunnerOutput).decode(frames)
    assert decoded.pooled_req_ids == ["b", "a"]
    np.testing.assert_array_equal(decoded.pooled, pooled)
    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput("a", [], pooled=pooled[1]), EngineCoreOutput("b", [])]
    )
    frames = Encoder().encode(outputs)
    assert len(frames) == 2
    got = Decoder(EngineCoreOutputs).decode(frames).outputs
    assert got[0].pooled.dtype == np.float32
    np.testing.assert_array_equal(got[0].pooled, pooled[1])
    assert got[1].pooled is None


class _Tensors(msgspec.Struct, array_like=True):
    big: np.ndarray
    small: np.ndarray
    strided: np.ndarray
    many: list[np.ndarray]
    maybe: np.ndarray | None = None
    named: dict[str, np.ndarray] = {}


def _tensors() -> _Tensors:
    rng = np.random.default_rng(0)
    return _Tensors(
        big=rng.standard_normal((64, 16), dtype=np.float32),  # 4 KiB: own frame
        small=np.arange(8, dtype=np.int32),  # 32 B: inline
        strided=np.arange(4096, dtype=np.int64).reshape(64, 64)[:, ::2],  # copied, own frame
        many=[np.ones(1000, dtype=np.float16), np.array([True, False]), rng.random(200)],
        maybe=np.arange(3, dtype=np.uint8),
        named={"ids": np.arange(512, dtype=np.int32), "scale": np.array(2.0)},
    )


def _assert_tensors_equal(got: _Tensors, want: _Tensors) -> None:
    for field in ("big", "small", "strided", "maybe"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
        assert getattr(got, field).dtype == getattr(want, field).dtype
    assert len(got.many) == len(want.many)
    for g, w in zip(got.many, want.many):
        np.testing.assert_array_equal(g, w)
        assert g.dtype == w.dtype
    assert got.named.keys() == want.named.keys()
    for key in want.named:
        np.testing.assert_array_equal(got.named[key], want.named[key])
        assert got.named[key].shape == want.named[key].shape


def test_large_arrays_travel_as_frames_and_small_ones_inline() -> None:
    obj = _tensors()
    frames = Encoder().encode(obj)
    # big, strided, many[0] (2000 B), many[2] (1600 B), named["ids"] (2048 B)
    assert len(frames) == 1 + 5
    _assert_tensors_equal(Decoder(_Tensors).decode(frames), obj)


def test_frames_are_zero_copy_both_ways() -> None:
    obj = _tensors()
    frames = Encoder().encode(obj)
    # The encoder exports the contiguous array's own memory...
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.uint8), obj.big)
    # ...and the decoder builds a view over the received frame.
    received = [bytes(f) for f in frames]
    decoded = Decoder(_Tensors).decode(received)
    assert np.shares_memory(decoded.big, np.frombuffer(received[1], dtype=np.uint8))
    assert not decoded.big.flags.writeable  # a view over immutable bytes


def test_size_threshold_decides_inline_or_frame() -> None:
    obj = _tensors()
    assert len(Encoder(size_threshold=1 << 20).encode(obj)) == 1
    # Threshold 0: every array gets a frame, even the 0-d one.
    every = Encoder(size_threshold=0).encode(obj)
    assert len(every) == 1 + 9
    _assert_tensors_equal(Decoder(_Tensors).decode(every), obj)


@pytest.mark.parametrize("threshold", [0, DEFAULT_SIZE_THRESHOLD])
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 0, 5)])
def test_empty_arrays_round_trip(shape: tuple[int, ...], threshold: int) -> None:
    arr = np.empty(shape, dtype=np.float32)
    got = _round_trip(arr, np.ndarray, size_threshold=threshold)
    assert got.shape == shape and got.dtype == np.float32


@pytest.mark.parametrize(
    "arr",
    [
        np.array(1.5, dtype=np.float16),  # 0-d
        np.arange(300, dtype=">i4"),  # big-endian keeps its byte order
        np.array([1 + 2j, 3 - 4j], dtype=np.complex64),
        np.array(["a", "héllo"]),
        np.array([b"x", b"yz"]),
        np.arange(100).astype("datetime64[s]"),
        np.arange(5).astype("timedelta64[ms]"),
        np.asfortranarray(np.arange(600, dtype=np.float64).reshape(20, 30)),
    ],
    ids=lambda a: str(a.dtype),
)
def test_dtypes_round_trip(arr: np.ndarray) -> None:
    got = _round_trip(arr, np.ndarray)
    assert got.dtype == arr.dtype and got.shape == arr.shape
    np.testing.assert_array_equal(got, arr)


@pytest.mark.parametrize(
    "arr",
    [
        np.array([object(), 1], dtype=object),
        np.zeros(3, dtype=[("a", "i4"), ("b", "f8")]),
        np.zeros(3, dtype=np.dtypes.StringDType()),
    ],
    ids=["object", "structured", "stringdtype"],
)
def test_unsupported_dtypes_are_refused(arr: np.ndarray) -> None:
    with pytest.raises(TypeError, match="cannot travel"):
        Encoder().encode(arr)


def test_numpy_scalars_encode_as_python_values() -> None:
    out = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[np.int64(5)]])
    assert _round_trip(out, ModelRunnerOutput).sampled_token_ids == [[5]]


def test_other_objects_are_refused() -> None:
    with pytest.raises(TypeError, match="Cannot encode"):
        Encoder().encode({"f": lambda: None})


# --- malformed input -------------------------------------------------------


def _array_body(dtype: Any, shape: Any, data: Any) -> bytes:
    """A body that holds one array, spelled by hand."""
    return msgspec.msgpack.encode([dtype, shape, data])


def _inline(raw: bytes, code: int = 3) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(code, raw)


@pytest.mark.parametrize(
    "frames, why",
    [
        ([], "Empty"),
        ([b""], "truncated"),
        ([b"\xc1"], "malformed"),
        ([_array_body("<i4", [2], 1)], "frame 1"),  # index with no such frame
        ([_array_body("<i4", [2], 0), b"\x00" * 8], "frame 0"),  # the body itself
        ([_array_body("<i4", [2], -1), b"\x00" * 8], "frame -1"),
        ([_array_body("<i4", [2], True), b"\x00" * 8], "inline bytes or a frame index"),
        ([_array_body("<i4", [3], 1), b"\x00" * 8], "needs 12 bytes"),
        ([_array_body("<i4", [3], _inline(b"\x00" * 8))], "needs 12 bytes"),
        ([_array_body("<i4", [2], _inline(b"\x00" * 8, code=1))], "ext code 1"),
        ([_array_body("|O", [1], _inline(b"\x00" * 8))], "cannot travel"),
        ([_array_body("i4,i4", [1], _inline(b"\x00" * 8))], "cannot travel"),
        ([_array_body("no-such", [1], _inline(b"\x00" * 8))], "Unknown array dtype"),
        ([_array_body("<i4", [-2], _inline(b""))], "non-negative"),
        ([_array_body("<i4", 2, _inline(b"\x00" * 8))], "non-negative"),
        ([_array_body("<i4", [2], 1), 12345], "Malformed"),  # not a buffer
        ([msgspec.msgpack.encode([1, 2])], "dtype"),
    ],
)
def test_malformed_arrays_raise_decode_error(frames: list[Any], why: str) -> None:
    with pytest.raises(DecodeError, match=why):
        Decoder(np.ndarray).decode(frames)


def test_every_truncation_of_a_body_raises_decode_error() -> None:
    body, *buffers = Encoder().encode(_engine_core_outputs())
    for end in range(len(body)):
        with pytest.raises(DecodeError):
            Decoder(EngineCoreOutputs).decode([body[:end], *buffers])


def test_missing_frames_raise_decode_error() -> None:
    frames = Encoder().encode(_tensors())
    with pytest.raises(DecodeError, match="frames 1..2"):
        Decoder(_Tensors).decode(frames[:3])


def test_a_message_of_another_type_raises_decode_error() -> None:
    frames = Encoder().encode(_engine_core_request())
    with pytest.raises(DecodeError, match="Expected"):
        Decoder(SchedulerOutput).decode(frames)


def test_invalid_sampling_params_on_the_wire_raise_decode_error() -> None:
    body = msgspec.msgpack.encode({"temperature": -1.0})
    with pytest.raises(DecodeError, match="temperature"):
        Decoder(SamplingParams).decode([body])


def test_deep_nesting_raises_decode_error() -> None:
    with pytest.raises(DecodeError):
        Decoder(Any).decode([b"\x91" * 100_000 + b"\x90"])


def _decode_or_error(type_: Any, frames: list[bytes]) -> Any:
    """The decoded message, or the DecodeError; any other exception escapes."""
    try:
        return Decoder(type_).decode(frames)
    except DecodeError as e:
        return e


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=512), extra=st.lists(st.binary(max_size=64), max_size=3))
@pytest.mark.parametrize("type_", [EngineCoreRequest, EngineCoreOutputs, _Tensors, Any])
def test_random_bytes_decode_or_raise_decode_error(type_: Any, body: bytes, extra: list[bytes]) -> None:
    result = _decode_or_error(type_, [body, *extra])
    assert isinstance(result, DecodeError) or type_ is Any or isinstance(result, type_)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_corrupted_messages_decode_or_raise_decode_error(data: st.DataObject) -> None:
    body, *buffers = Encoder().encode(_tensors())
    corrupt = bytearray(body)
    for _ in range(data.draw(st.integers(1, 4))):
        corrupt[data.draw(st.integers(0, len(corrupt) - 1))] = data.draw(st.integers(0, 255))
    result = _decode_or_error(_Tensors, [bytes(corrupt), *buffers])
    assert isinstance(result, (DecodeError, _Tensors))
