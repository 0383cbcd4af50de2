"""``gguf.GGUFReader`` without the per-element walk over metadata arrays: the engine's reader.

``TensorsReader`` reads through ``services.gguf_plain.PlainArrayReader``'s plain view of
the file's map, and goes further. The stock walk turns every
element of every metadata array into numpy views, one slice at a time: for a
tokenizer's vocabulary (49k strings in SmolLM2, 262k in Gemma 3) that is
seconds of CPU at every engine start, for fields the engine never reads (it
takes the tokenizer from the HF folder). This reader keeps each such array as
one raw byte range: the array's values are not available through ``fields``,
everything else (scalar and string fields, ``tensors`` and their data) is the
stock reader's.
"""

from __future__ import annotations

import struct

import numpy as np
from gguf import GGUFValueType

from services.gguf_plain import PlainArrayReader

_ARRAY_HEADER = struct.Struct("<IQ")  # element type, element count
_STRING_LENGTH = struct.Struct("<Q")


class TensorsReader(PlainArrayReader):
    """A GGUF file's tensors and scalar metadata; metadata arrays are skipped over."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)  # big-endian files: the stock walk
        item_type, count = _ARRAY_HEADER.unpack_from(self.data, orig_offs)
        size = _ARRAY_HEADER.size + self._array_bytes(orig_offs + _ARRAY_HEADER.size, item_type, count)
        raw = self._get(orig_offs, np.uint8, size)
        return size, [raw], [], [GGUFValueType.ARRAY, GGUFValueType(item_type)]

    def _array_bytes(self, offs: int, item_type: int, count: int) -> int:
        """Bytes taken by ``count`` values of ``item_type`` starting at ``offs``."""
        scalar = self.gguf_scalar_to_np.get(GGUFValueType(item_type))
        if scalar is not None:
            return count * np.dtype(scalar).itemsize
        start = offs
        if item_type == GGUFValueType.STRING:
            for _ in range(count):
                (length,) = _STRING_LENGTH.unpack_from(self.data, offs)
                offs += _STRING_LENGTH.size + length
            return offs - start
        if item_type == GGUFValueType.ARRAY:
            for _ in range(count):
                inner_type, inner_count = _ARRAY_HEADER.unpack_from(self.data, offs)
                offs += _ARRAY_HEADER.size
                offs += self._array_bytes(offs, inner_type, inner_count)
            return offs - start
        raise ValueError(f"Unknown GGUF array element type {item_type} at offset {offs}.")
