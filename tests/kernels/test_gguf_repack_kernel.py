"""The compiled load-time repack (``csrc/gguf_repack.cpp``) against its numpy twins in
``services.worker.gguf_repack``: Q4_K's and Q5_K's super-blocks (``k_records_and_nibbles_ref``) and
the byte fields every format's blocks are cut into (``quants_ref``)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kernels import cpu_fused
from services.worker import gguf_repack

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the CPU kernels with"
)

# (block bytes, where the 128 bytes of nibbles start): Q4_K, Q5_K.
LAYOUTS = {"Q4_K": (144, 16), "Q5_K": (176, 48)}


def random_blocks(rows: int, supers: int, block_bytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(rows, supers, block_bytes), dtype=np.uint8)


@pytest.mark.parametrize("fmt", LAYOUTS)
# One super-block, rows the parallel split leaves ragged, and a row count above its grain.
@pytest.mark.parametrize(("rows", "supers"), [(1, 1), (3, 5), (173, 8), (1100, 2)])
def test_compiled_repack_matches_the_twin_bit_for_bit(fmt, rows, supers):
    block_bytes, qs_start = LAYOUTS[fmt]
    blocks = random_blocks(rows, supers, block_bytes, seed=rows)
    assert cpu_fused.available()
    records, nibbles = gguf_repack._k_records_and_nibbles(blocks, qs_start)
    ref_records, ref_nibbles = gguf_repack.k_records_and_nibbles_ref(blocks, qs_start)
    assert records.shape == ref_records.shape == (rows, supers, 20)
    assert nibbles.shape == ref_nibbles.shape == (rows, supers, 8, 16)
    assert np.array_equal(records, ref_records)
    assert np.array_equal(nibbles, ref_nibbles)


@pytest.mark.parametrize("fmt", LAYOUTS)
def test_both_paths_rebuild_ggufs_dequantization(fmt, monkeypatch):
    """Read-only file bytes (as the GGUF map is) through the compiled path and the numpy one
    give the same packed weight, which dequantizes to gguf's own weights. (gguf has no K-format
    quantizer: random bytes with sane fp16 d and dmin.)"""
    block_bytes, _ = LAYOUTS[fmt]
    blocks = random_blocks(16, 2, block_bytes, seed=2)
    halves = np.random.default_rng(3).uniform(0.001, 0.01, (16, 2, 2)).astype(np.float16)
    blocks[..., :4] = halves.view(np.uint8)
    data = blocks.reshape(16, -1)
    data.setflags(write=False)
    compiled = gguf_repack.repack(fmt, data, 512)
    monkeypatch.setattr(cpu_fused, "available", lambda: False)
    twin = gguf_repack.repack(fmt, data, 512)
    for part in ("qweight", "scales", "qhigh"):
        a, b = getattr(compiled, part), getattr(twin, part)
        assert (a is None and b is None) or torch.equal(a, b), part
    expected = dequantize(data, GGMLQuantizationType[fmt]).astype(np.float32)
    assert torch.equal(compiled.dequantize(), torch.from_numpy(expected))


# Every field a repacker cuts: Q8_0's quants, Q5_0's qh, Q5_1's m, Q6_K's qh and a field reaching the
# block's end, a lone byte.
@pytest.mark.parametrize(
    ("block_bytes", "start", "stop"),
    [(34, 2, 34), (22, 2, 6), (24, 2, 4), (210, 128, 192), (210, 208, 210), (18, 0, 1)],
)
@pytest.mark.parametrize(("rows", "blocks_per_row"), [(1, 1), (37, 3), (3000, 2)])
def test_compiled_block_fields_match_the_twin(block_bytes, start, stop, rows, blocks_per_row):
    blocks = random_blocks(rows, blocks_per_row, block_bytes, seed=start)
    blocks.setflags(write=False)  # as the GGUF map
    assert cpu_fused.available()
    got = gguf_repack._quants(blocks, start, stop)
    assert got.shape == (rows, blocks_per_row, stop - start) and got.flags.c_contiguous
    assert np.array_equal(got, gguf_repack.quants_ref(blocks, start, stop))
    assert np.array_equal(got, blocks[..., start:stop])


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q6_K"])
def test_every_format_packs_the_same_through_either_path(fmt, monkeypatch):
    rng = np.random.default_rng(4)
    qtype = GGMLQuantizationType[fmt]
    if fmt == "Q6_K":  # gguf has no K-format quantizer: random bytes with a sane fp16 d
        blocks = rng.integers(0, 256, (8, 2, 210), dtype=np.uint8)
        blocks[..., 208:210] = rng.uniform(0.001, 0.01, (8, 2, 1)).astype(np.float16).view(np.uint8)
        data = blocks.reshape(8, -1)
    else:
        data = quantize(rng.standard_normal((8, 512)).astype(np.float32), qtype)
    data.setflags(write=False)
    compiled = gguf_repack.repack(fmt, data, 512)
    monkeypatch.setattr(cpu_fused, "available", lambda: False)
    twin = gguf_repack.repack(fmt, data, 512)
    for part in ("qweight", "scales", "mins", "qhigh"):
        a, b = getattr(compiled, part), getattr(twin, part)
        assert (a is None and b is None) or torch.equal(a, b), part
    assert torch.equal(compiled.dequantize(), torch.from_numpy(dequantize(data, qtype).astype(np.float32)))


def test_bad_arguments_are_refused():
    blocks = torch.zeros(2, 3, 144, dtype=torch.uint8)
    records = torch.empty(2, 3, 20, dtype=torch.uint8)
    nibbles = torch.empty(2, 3, 128, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="nibbles .* must follow the scales"):
        cpu_fused.k_records_and_nibbles(records, nibbles, blocks, 17)
    with pytest.raises(RuntimeError, match="nibbles .* must follow the scales"):
        cpu_fused.k_records_and_nibbles(records, nibbles, blocks, 8)
    with pytest.raises(RuntimeError, match=r"blocks \[N, B, bytes\] contiguous uint8"):
        cpu_fused.k_records_and_nibbles(records, nibbles, blocks.float(), 16)
    with pytest.raises(RuntimeError, match=r"records \[N, B, 20\]"):
        cpu_fused.k_records_and_nibbles(records[:1], nibbles, blocks, 16)
    with pytest.raises(RuntimeError, match="nibbles of N \\* B \\* 128"):
        cpu_fused.k_records_and_nibbles(records, nibbles[:, :2], blocks, 16)
    with pytest.raises(RuntimeError, match=r"\[start, stop\) must lie inside a 144-byte block"):
        cpu_fused.block_bytes(torch.empty(2, 3, 10, dtype=torch.uint8), blocks, 140, 150)
    with pytest.raises(RuntimeError, match=r"\[start, stop\) must lie inside"):
        cpu_fused.block_bytes(torch.empty(0, dtype=torch.uint8), blocks, 5, 5)
    with pytest.raises(RuntimeError, match="out of N \\* B \\* \\(stop - start\\)"):
        cpu_fused.block_bytes(torch.empty(2, 3, 9, dtype=torch.uint8), blocks, 0, 10)
