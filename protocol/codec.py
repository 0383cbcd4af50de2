"""The wire codec: msgpack bodies, numpy arrays as extra zero-copy frames.

``Encoder.encode(obj)`` returns a list of frames: the msgpack body first,
then the raw backing buffer of every large array, in the order the body
refers to them. An array appears in the body as ``(dtype str, shape, data)``
where ``data`` is either the index of its frame (large arrays, sent as they
lie in memory) or an inline msgpack ext holding its bytes (small arrays,
where a separate frame would cost more than the copy).

``Decoder(T).decode(frames)`` decodes the body against ``T`` and rebuilds
each large array as a view over its received frame, with no copy: the frame
stays alive as long as the array does, and the array is read-only when the
frame is (``bytes``, ZMQ frames); copy an array before changing it. Arrays
are rebuilt only where ``T`` says ``numpy.ndarray`` (a Struct field, a list
item, a dict value...).

Nothing is ever pickled. Any frame that does not decode to a valid ``T`` --
random bytes, a truncated body, another message's type, a bad frame index
or byte count -- raises ``DecodeError`` and nothing else, so a receiving
process can log it, drop it and keep serving.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

# Arrays smaller than this travel inside the body (vLLM uses the same cut-off).
DEFAULT_SIZE_THRESHOLD = 256

# Ext code of an inline array's bytes. Part of the wire contract.
_EXT_INLINE = 3

# Booleans, integers, floats, complex, timedeltas, datetimes, bytes, str.
_WIRE_DTYPE_KINDS = frozenset("biufcmMSU")

# A dtype string longer than this is not one numpy writes (``dtype.str``).
_MAX_DTYPE_STR = 32

T = TypeVar("T")

Frame = bytes | bytearray | memoryview


class DecodeError(ValueError):
    """A message could not be decoded: malformed, truncated or of another type."""


class Encoder:
    """Encodes messages into frames. Not thread-safe: one per thread."""

    def __init__(self, size_threshold: int = DEFAULT_SIZE_THRESHOLD) -> None:
        if size_threshold < 0:
            raise ValueError(f"size_threshold must be non-negative, got {size_threshold}.")
        self.size_threshold = size_threshold
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        # Out-of-band buffers of the message being encoded; slot 0 is the body.
        self._frames: list[bytes | memoryview] | None = None

    def encode(self, obj: Any) -> list[bytes | memoryview]:
        """Return ``[body, buffer, ...]``; buffers are views, not copies."""
        frames: list[bytes | memoryview] = [b""]
        self._frames = frames
        try:
            frames[0] = self._encoder.encode(obj)
        finally:
            self._frames = None
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return self._encode_array(obj)
        if isinstance(obj, (np.bool_, np.integer, np.floating)):
            return obj.item()
        raise TypeError(f"Cannot encode an object of type {type(obj).__name__} on the wire.")

    def _encode_array(self, arr: np.ndarray) -> tuple[str, list[int], Any]:
        _check_wire_dtype(arr.dtype, TypeError)
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        shape = list(arr.shape)
        if arr.nbytes < self.size_threshold:
            return arr.dtype.str, shape, msgspec.msgpack.Ext(_EXT_INLINE, arr.tobytes())
        assert self._frames is not None, "arrays are only encoded inside encode()"
        # A flat uint8 view exports a plain byte buffer for any dtype (even
        # ones memoryview cannot describe, like datetime64) and keeps `arr`
        # alive for as long as the frame is referenced.
        self._frames.append(arr.reshape(-1).view(np.uint8).data)
        return arr.dtype.str, shape, len(self._frames) - 1


class Decoder(Generic[T]):
    """Decodes frames from ``Encoder`` against one type. Not thread-safe."""

    def __init__(self, type: type[T]) -> None:
        self._decoder = msgspec.msgpack.Decoder(type, dec_hook=self._dec_hook, ext_hook=self._ext_hook)
        self._frames: Sequence[Frame] = ()

    def decode(self, frames: Sequence[Frame]) -> T:
        if not frames:
            raise DecodeError("Empty message: no frames to decode.")
        self._frames = frames
        try:
            return self._decoder.decode(frames[0])
        except DecodeError:
            raise
        # This is the trust boundary: whatever the peer sent, the caller sees
        # one exception type, with the underlying cause chained.
        except Exception as e:
            raise DecodeError(f"Malformed message: {e}") from e
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, data: memoryview) -> bytes:
        if code != _EXT_INLINE:
            raise DecodeError(f"Unknown msgpack ext code {code}.")
        # A copy (small by construction), so the array does not pin the body.
        return bytes(data)

    def _dec_hook(self, target: Any, obj: Any) -> Any:
        # ValueErrors raised here come back as msgspec.ValidationError with
        # the path of the offending field, then as DecodeError from decode().
        if target is not np.ndarray:
            raise ValueError(f"No decoder for type {target!r}.")
        if not (isinstance(obj, list) and len(obj) == 3):
            raise ValueError("An array must be encoded as [dtype, shape, data].")
        dtype_str, shape, data = obj
        dtype = _parse_dtype(dtype_str)
        shape = _parse_shape(shape)
        buffer = self._inline_or_frame(data)
        nbytes = math.prod(shape) * dtype.itemsize
        if buffer.nbytes != nbytes:
            raise ValueError(
                f"Array of dtype {dtype.str} and shape {tuple(shape)} needs {nbytes} bytes, "
                f"its buffer has {buffer.nbytes}."
            )
        if nbytes == 0:
            return np.empty(shape, dtype=dtype)
        return np.frombuffer(buffer, dtype=dtype).reshape(shape)

    def _inline_or_frame(self, data: Any) -> memoryview:
        if isinstance(data, bytes):
            return memoryview(data)
        if type(data) is not int:  # bool is an int subclass; refuse it
            raise ValueError("Array data must be inline bytes or a frame index.")
        if not 1 <= data < len(self._frames):
            raise ValueError(
                f"Array refers to frame {data}, but the message has frames 1..{len(self._frames) - 1}."
            )
        return memoryview(self._frames[data]).cast("B")


def _check_wire_dtype(dtype: np.dtype, error: type[Exception]) -> None:
    """Allow only dtypes whose bytes are their value and whose ``dtype.str``
    rebuilds them: no objects, no structured records, no StringDType."""
    if dtype.kind not in _WIRE_DTYPE_KINDS:
        raise error(f"Arrays of dtype {dtype} cannot travel on the wire; use a plain numeric dtype.")
    if dtype.itemsize == 0:
        raise error(f"Arrays of dtype {dtype} have no size and cannot travel on the wire.")


def _parse_dtype(dtype_str: Any) -> np.dtype:
    if not isinstance(dtype_str, str) or len(dtype_str) > _MAX_DTYPE_STR:
        raise ValueError("Array dtype must be a short numpy dtype string.")
    try:
        dtype = np.dtype(dtype_str)
    except TypeError as e:
        raise ValueError(f"Unknown array dtype {dtype_str!r}.") from e
    _check_wire_dtype(dtype, ValueError)
    return dtype


def _parse_shape(shape: Any) -> list[int]:
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError("Array shape must be a list of non-negative integers.")
    if len(shape) > 64:  # numpy's own limit on dimensions
        raise ValueError(f"Array has {len(shape)} dimensions; numpy allows at most 64.")
    return shape
