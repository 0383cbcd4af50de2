"""The GGUF readers: over a plain array, the stock reader's fields and tensors; the tensors-only
reader, the stock reader's tensors and scalar fields, arrays skipped."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from services.gguf_plain import PlainArrayReader
from services.worker.gguf_reader import TensorsReader


def write_gguf(path: Path) -> Path:
    """Metadata arrays of every kind (strings, ints, floats, nested) around two tensors."""
    writer = GGUFWriter(str(path), arch="llama")
    writer.add_string("general.name", "tiny")
    writer.add_uint32("llama.context_length", 512)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "héllo", "", "x" * 300] * 50)
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.25] * 100)
    writer.add_array("tokenizer.ggml.token_type", [1, 2, 3])
    writer.add_array("test.empty", [])
    writer.add_array("test.nested", [["a", "bc"], ["def"]])
    writer.add_float32("llama.rope.freq_base", 10000.0)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((7, 16)).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.standard_normal(16).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_plain_array_reader_reads_what_the_stock_reader_reads(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    stock, plain = GGUFReader(path), PlainArrayReader(path)
    assert type(plain.data) is np.ndarray and not plain.data.flags.writeable  # the file's map, read-only
    assert list(plain.fields) == list(stock.fields)
    for name, field in stock.fields.items():
        ours = plain.fields[name]
        assert ours.contents() == field.contents(), name
        assert (ours.offset, ours.data, ours.types) == (field.offset, field.data, field.types), name
        # transformers parses each element from its parts: the same bytes, dtypes and shapes
        assert [(bytes(p), p.dtype, p.shape) for p in ours.parts] == [
            (bytes(p), p.dtype, p.shape) for p in field.parts
        ], name
    for ours, theirs in zip(plain.tensors, stock.tensors, strict=True):
        assert (ours.name, ours.tensor_type, ours.shape.tolist()) == (
            theirs.name,
            theirs.tensor_type,
            theirs.shape.tolist(),
        )
        assert np.array_equal(ours.data, theirs.data) and ours.data.dtype == theirs.data.dtype


def test_tensors_and_scalar_fields_are_the_stock_readers(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    stock, ours = GGUFReader(path), TensorsReader(path)
    assert list(ours.fields) == list(stock.fields) and ours.data_offset == stock.data_offset
    for name, field in stock.fields.items():
        if field.types[0] != GGUFValueType.ARRAY:
            assert [bytes(p) for p in ours.fields[name].parts] == [bytes(p) for p in field.parts], name
            assert ours.fields[name].contents() == field.contents(), name
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in stock.tensors
    ]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, stock.tensors))


def test_an_array_is_one_raw_byte_range_of_its_exact_size(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    stock, ours = GGUFReader(path), TensorsReader(path)
    for name in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "test.nested"):
        (raw,) = ours.fields[name].parts[3:]  # after the key's length, key and value type
        assert raw.nbytes == sum(p.nbytes for p in stock.fields[name].parts[3:]), name
        assert ours.fields[name].types == stock.fields[name].types[:2] and ours.fields[name].data == []
