"""The compiled load-time repack of Q4_K's and Q5_K's super-blocks (``csrc/gguf_repack.cpp``) against
its numpy twin, ``services.worker.gguf_repack.k_records_and_nibbles_ref``."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

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
