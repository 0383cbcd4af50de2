"""The stock ``gguf.GGUFReader`` over a plain array, and transformers' reads of a GGUF parsed once.

The stock reader slices an ``np.memmap``, whose every slice and view runs
``memmap``'s Python hooks: hundreds of thousands of them to parse a
tokenizer's metadata or to dequantize a model's tensors. ``PlainArrayReader``
reads the same mapped bytes through a plain ``ndarray`` view of the map (the
view keeps the map open): the same fields and tensors, parsed three times
faster. Torch-free: the API process prepares a GGUF's HF folder with it
(``services.model_files.prepare``); the engine's reader
(``services.worker.gguf_reader.TensorsReader``) builds on it.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
from gguf import GGUFReader


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
