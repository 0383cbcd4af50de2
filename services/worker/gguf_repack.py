"""GGUF quantized blocks -> the packed layouts of ``PackedWeight``, without going through fp32.

| GGUF   | block            | packed as                                           | bytes/param | x file |
|--------|------------------|-----------------------------------------------------|-------------|--------|
| Q8_0   | 32: d, 32 x int8 | int8, scale d (fp16) per 32                         | 1.0625      | 1.0    |
| Q5_0   | 32: d, 5-bit q   | int8 q - 16, scale d (fp16) per 32                  | 1.0625      | 1.55   |
| Q6_K   | 256: 16 x 16     | int8 q - 32; per 256 d (fp16), 16 x int8 sc         | 1.0703      | 1.30   |
| Q4_0   | 32: d, 4-bit q   | int4 q, scale d (fp16) per 32, min -8 d implied     | 0.5625      | 1.0    |
| Q4_1   | 32: d, m, 4-bit q| int4 q, scale d, min m (fp16) per 32                | 0.625       | 1.0    |
| Q4_K   | 256: 8 x 32      | int4 q; per 256 d, dmin (fp16), 8 x uint8 sc and m  | 0.5781      | 1.03   |

The 32-element formats keep their blocks' own fp16 ``d`` (and ``m``; Q4_0
stores none, the kernels form ``-8 d`` in fp32 as they read ``d``). The K
formats keep a record per super-block of 256 (``scales [N, K / 256, 20 or
18]`` uint8: ``kernels.reference.super_scales_ref``): the block's halves and
its groups' 6-bit scales and mins a byte each, whose products ``d * sc`` and
``-(dmin * m)`` the kernels form in fp32, exactly (a half times an integer
under 2^8). Past 1,024 groups a row (K > 32,768 at 32 a group) every format
takes fp32 scales and mins per group instead (the kernels' bound). Either way the
packed weights rebuild the gguf package's dequantization bit for bit. Other
types (F16, BF16, Q5_1, Q5_K, ...) have no packed layout here and are
dequantized at load.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.reference import group_scales
from services.worker.layers.quantized_linear import PackedWeight

_QK = 32  # elements per block of the 32-element formats
_QK_K = 256  # elements per super-block of the K formats
_MAX_HALF_GROUPS = 1024


def packable(type_name: str) -> bool:
    return type_name in _REPACKERS


def repack(
    type_name: str, data: np.ndarray, in_features: int, row_order: np.ndarray | None = None
) -> PackedWeight:
    """``data``: the tensor's raw blocks, ``[N, bytes per row]`` uint8, as ``GGUFReader`` maps them;
    ``row_order``: the rows to keep, in that order (default: all, as stored)."""
    data = np.asarray(data, dtype=np.uint8)
    if row_order is not None:
        data = data[row_order]  # whole rows of blocks: one copy, before anything is split
    rows = data.shape[0]
    block_elems = _QK_K if type_name.endswith("_K") else _QK
    blocks = data.reshape(rows, in_features // block_elems, -1)
    qweight, scales, mins, group = _REPACKERS[type_name](blocks)
    qweight = torch.from_numpy(np.ascontiguousarray(qweight.reshape(rows, -1)))
    # The kernels read fp16 scales, implied mins and the K formats' records up to 1,024 groups a row
    # (cpu_quant_linear.cpp, RowScales); past that, fp32 scales and mins per group.
    compact = in_features // group <= _MAX_HALF_GROUPS
    if scales.dtype == np.uint8:  # the K formats' records, [N, blocks, bytes]
        scales = torch.from_numpy(np.ascontiguousarray(scales))
        if not compact:
            scales, mins = group_scales(qweight, scales, None, group)
    else:
        scales = torch.from_numpy(np.ascontiguousarray(scales.reshape(rows, -1)))
        mins = None if mins is None else torch.from_numpy(np.ascontiguousarray(mins.reshape(rows, -1)))
        if not compact:
            scales, mins = group_scales(qweight, scales, mins, group)
    return PackedWeight(qweight, scales, mins, group, in_features, type_name)


def _halves(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte ``start`` of each block, ``[N, blocks]`` fp16."""
    return np.ascontiguousarray(_field(blocks, start, "<f2"))


def _quants(blocks: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Bytes ``[start, stop)`` of each block, ``[N, blocks, stop - start]`` uint8, contiguous.

    Copied as one ``stop - start``-byte item per block: numpy copies a strided byte slice a byte
    at a time, several times slower, and a 1B model's load copies 600 MB this way."""
    items = np.ascontiguousarray(_field(blocks, start, f"V{stop - start}"))
    return items.view(np.uint8).reshape(*blocks.shape[:2], stop - start)


def _field(blocks: np.ndarray, start: int, dtype: str) -> np.ndarray:
    """The ``dtype`` item at byte ``start`` of each block, ``[N, blocks]``, a view of ``blocks``."""
    if not blocks.flags.c_contiguous:
        blocks = np.ascontiguousarray(blocks)
    record = np.dtype({"names": ["f"], "formats": [dtype], "offsets": [start], "itemsize": blocks.shape[-1]})
    return blocks.view(record)[..., 0]["f"]


def _nibbles_to_int4(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Values ``[..., 32]`` in [0, 16) -> 16 bytes per group: element j low, element j + 16 high."""
    return (low | (high << np.uint8(4))).astype(np.uint8)


def _q8_0(blocks):
    return _quants(blocks, 2, 34).view(np.int8), _halves(blocks, 0), None, 32


def _q5_0(blocks):
    qh = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)  # [N, B, 1]: bit j is element j's fifth bit
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, B, 32]
    qs = blocks[..., 6:22]
    low = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # [N, B, 32]
    return (low | (high << 4)).astype(np.int8) - np.int8(16), _halves(blocks, 0), None, 32


def _q4_0(blocks):
    # No mins: the kernels take each as -8 d (exact in fp32), so none are stored.
    return _quants(blocks, 2, 18), _halves(blocks, 0), None, 32


def _q4_1(blocks):
    return _quants(blocks, 4, 20), _halves(blocks, 0), _halves(blocks, 2), 32


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 6-bit (scale, min) pairs of each super-block, from its 12 bytes, as uint8."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), axis=-1)
    mn = np.concatenate((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), axis=-1)
    return sc, mn


def _q4_k(blocks):
    sc, mn = _q4_k_scales(blocks[..., 4:16])
    records = np.concatenate((blocks[..., 0:4], sc, mn), axis=-1)  # d, dmin (fp16), 8 sc, 8 m: 20 bytes
    qs = blocks[..., 16:144].reshape(
        *blocks.shape[:2], 4, 32
    )  # 4 chunks of 64: low nibbles 0..31, high 32..63
    values = np.stack((qs & 0x0F, qs >> 4), axis=-2).reshape(*blocks.shape[:2], 8, 32)  # 8 groups of 32
    return _nibbles_to_int4(values[..., :16], values[..., 16:]), records, None, 32


def _q6_k(blocks):
    shape = blocks.shape[:2]
    ql = blocks[..., :128].reshape(*shape, 2, 1, 64)
    qh = blocks[..., 128:192].reshape(*shape, 2, 1, 32)
    low = np.concatenate((ql & 0x0F, ql >> 4), axis=-2).reshape(*shape, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 0x03  # [N, B, 2, 4, 32]
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    records = np.concatenate((blocks[..., 208:210], blocks[..., 192:208]), axis=-1)  # d (fp16), 16 int8 sc
    return q.reshape(*shape, _QK_K), records, None, 16


_REPACKERS = {"Q8_0": _q8_0, "Q5_0": _q5_0, "Q6_K": _q6_k, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k}
