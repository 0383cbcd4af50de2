"""make-model's K-quant quantizers: blocks the gguf package (llama.cpp's layout) reads back as the
values they were made from, to within the format's rounding."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import Q4_K, dequantize, quantize

from benchmarks.bench import kquants

# Each K type against the 32-element type of as many bits a weight or fewer: at least as close.
_PEERS = {"Q4_K": "Q4_0", "Q5_K": "Q5_0", "Q6_K": "Q5_0"}


def _rows(seed: int, shape=(48, 1024), std=0.03) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * std).astype(np.float32)


def _relative_error(rows: np.ndarray, type_name: str, blocks: np.ndarray) -> float:
    back = dequantize(blocks, GGMLQuantizationType[type_name])
    assert back.shape == rows.shape
    return float(np.sqrt(np.mean((back - rows) ** 2)) / rows.std())


@pytest.mark.parametrize("type_name", kquants.TYPES)
def test_blocks_read_back_as_the_values_they_were_made_from(type_name: str) -> None:
    rows = _rows(0)
    rows[3] += 0.05  # a row whose groups all sit above zero: the min is clamped to 0
    rows[5, :256] = 0.0  # an all-zero super-block: zero scales, zero weights
    blocks = kquants.quantize(rows, type_name)
    qtype = GGMLQuantizationType[type_name]
    assert blocks.dtype == np.uint8 and blocks.shape == (48, 1024 // 256 * GGML_QUANT_SIZES[qtype][1])
    error = _relative_error(rows, type_name, blocks)
    peer = _PEERS[type_name]
    assert error <= _relative_error(rows, peer, quantize(rows, GGMLQuantizationType[peer]))
    assert np.all(dequantize(blocks, qtype)[5, :256] == 0.0)
    # A wrong layout (a nibble or bit plane in another element's place) is an error of the
    # order of the values themselves; rounding is a small fraction of them.
    assert error < {"Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.025}[type_name]


def test_the_six_bit_scales_and_mins_pack_as_llama_cpp_unpacks_them() -> None:
    rng = np.random.default_rng(1)
    sc, m = (rng.integers(0, 64, size=(100, 8), dtype=np.uint8) for _ in range(2))
    unpacked_sc, unpacked_m = Q4_K.get_scale_min(kquants._pack_scales(sc, m))
    assert np.array_equal(unpacked_sc, sc) and np.array_equal(unpacked_m, m)


def test_rows_of_a_partial_block_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 256 values, got 320"):
        kquants.quantize(np.zeros((2, 320), np.float32), "Q4_K")
