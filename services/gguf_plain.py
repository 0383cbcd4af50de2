"""The stock ``gguf.GGUFReader`` over a plain array, and transformers' reads of a GGUF parsed once.

The stock reader slices an ``np.memmap``, whose every slice and view runs
``memmap``'s Python hooks: hundreds of thousands of them to parse a
tokenizer's metadata or to dequantize a model's tensors. ``PlainArrayReader``
reads the same mapped bytes through a plain ``ndarray`` view of the map (the
view keeps the map open), and cuts a metadata array of strings or numbers into
its elements' parts in one loop, where the stock reader recurses into each
element and builds each part with three views: the same fields and tensors,
parsed about ten times faster. Torch-free: the API process prepares a GGUF's HF folder with it
(``services.model_files.prepare``); the engine's reader
(``services.worker.gguf_reader.TensorsReader``) builds on it.
"""

from __future__ import annotations

import contextlib
import functools
import struct

import numpy as np
from gguf import GGUFReader, GGUFValueType

_ARRAY_HEADER = struct.Struct("<IQ")  # element type, element count
_STRING_LENGTH = struct.Struct("<Q")


class PlainArrayReader(GGUFReader):
    """The stock reader (every field parsed), over a plain ``ndarray`` view of the file's map."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        # GGUFReader.__init__ assigns its np.memmap here; the view shares its pages (read-only
        # in the default mode 'r') and keeps it alive through ``base``.
        self._data = mapped.view(np.ndarray)

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        """The stock parts, types and data indices; an array of strings or numbers in one loop.

        Each element of such an array is one part (a number) or two (a string's length and its
        bytes), as the stock recursion makes them, cut from one view of the array's bytes.
        Nested arrays, and files of the other byte order, take the stock walk."""
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = _ARRAY_HEADER.unpack_from(self.data, orig_offs)
        if item_type == GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        offs = orig_offs + _ARRAY_HEADER.size
        parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        if item_type == GGUFValueType.STRING:
            size, elements, data = self._string_parts(offs, count)
        else:
            size, elements, data = self._scalar_parts(offs, item_type, count)
        types = [GGUFValueType.ARRAY] + ([GGUFValueType(item_type)] if count else [])
        return _ARRAY_HEADER.size + size, parts + elements, data, types

    def _string_parts(self, offs: int, count: int) -> tuple[int, list[np.ndarray], list[int]]:
        """Each string's length (uint64) and bytes (uint8); the bytes are the data (indices 3, 5...)."""
        start, parts, data = offs, [], self.data
        for _ in range(count):
            (length,) = _STRING_LENGTH.unpack_from(data, offs)
            body = offs + _STRING_LENGTH.size
            parts += (data[offs:body].view(np.uint64), data[body : body + length])
            offs = body + length
        return offs - start, parts, list(range(3, 2 * count + 2, 2))

    def _scalar_parts(self, offs: int, item_type: int, count: int) -> tuple[int, list[np.ndarray], list[int]]:
        """Each number a one-element array, as the stock reader's; each is data (indices 2, 3...)."""
        dtype = np.dtype(self.gguf_scalar_to_np[GGUFValueType(item_type)])
        values = self.data[offs : offs + count * dtype.itemsize].view(dtype)
        return count * dtype.itemsize, [values[i : i + 1] for i in range(count)], list(range(2, count + 2))


@contextlib.contextmanager
def gguf_parsed_once():
    """While open, each GGUF file is parsed once however often it is opened, over a plain array.

    For transformers' reads of a GGUF (``services.model_files.prepare``, and the tests' loads of
    their oracle models). It swaps attributes of the ``gguf`` module: open it in one thread.

    transformers opens a GGUF twice when it loads a model from one (for the
    config, then for the weights), and each ``GGUFReader`` walks every
    metadata field in Python: the tokenizer's 49k (SmolLM2) to 262k (Gemma 3)
    strings. That walk, not the dequantization, is most of the load. The
    reader is only read from, so the second open can be the first reader; and
    it is the stock reader over a plain view of the file's map
    (``PlainArrayReader``: the same fields and tensors, without ``np.memmap``'s
    Python hooks on each of the walk's and the dequantization's slices).

    transformers also builds gguf's tensor name map (every name of every
    block, formatted in Python) once for each submodule of the model it maps
    names for: 397 times for SmolLM2's, seconds in all. The map is only read
    from too, so one per (architecture, block count) serves them all.
    """
    import gguf

    if getattr(gguf.GGUFReader, "parsed_once", False):  # nested: the outer context's readers serve
        yield
        return
    original_reader, original_name_map, readers = gguf.GGUFReader, gguf.get_tensor_name_map, {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = PlainArrayReader(path, mode)
        return readers[key]

    reader.parsed_once = True
    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(original_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map
