"""GGUF quantized blocks -> the packed layouts of ``PackedWeight``, without going through fp32.

| GGUF   | block            | packed as                                      | bytes/param |
|--------|------------------|------------------------------------------------|-------------|
| Q8_0   | 32: d, 32 x int8 | int8, scale d (fp16) per 32                    | 1.0625      |
| Q5_0   | 32: d, 5-bit q   | int8 q - 16, scale d (fp16) per 32             | 1.0625      |
| Q6_K   | 256: 16 x 16     | int8 q - 32, scale d * sc per 16               | 1.25        |
| Q4_0   | 32: d, 4-bit q   | int4 q, scale d (fp16) per 32, min -8 d implied | 0.5625     |
| Q4_1   | 32: d, m, 4-bit q| int4 q, scale d, min m (fp16) per 32           | 0.625       |
| Q4_K   | 256: 8 x 32      | int4 q, scale d * sc, min -dmin * m per 32     | 0.75        |

The K formats keep fp32 scales and mins: every product ``d * sc`` is then
exact (a half times a small integer). The 32-element formats keep their
blocks' own fp16 ``d`` (and ``m``; Q4_0 stores none, the kernels form
``-8 d`` in fp32 as they read ``d``), so they cost 0.0625 B/param for scales
(and as much for stored mins) and hold no more than the file: Q4_0, Q4_1
and Q8_0 exactly the file's bytes, Q5_0 (widened to int8) 1.55x. Either way the
packed weights rebuild the gguf package's dequantization bit for bit. Other
types (F16, BF16, Q5_1, Q5_K, ...) have no packed layout here and are
dequantized at load.
"""

from __future__ import annotations

import numpy as np
import torch

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
    # fp16 where the format's scales are its blocks' own halves, fp32 where they are products (and
    # past the kernels' 1,024 fp16 groups a row: cpu_quant_linear.cpp, RowScales).
    half = scales.dtype == np.float16 and in_features // group <= _MAX_HALF_GROUPS
    dtype = np.float16 if half else np.float32
    if type_name == "Q4_0" and not half:
        # Past 1,024 groups a row the kernels take implied mins no more (cpu_quant_linear.cpp, RowScales).
        mins = scales.astype(np.float32) * np.float32(-8)
    return PackedWeight(
        qweight=torch.from_numpy(np.ascontiguousarray(qweight.reshape(rows, -1))),
        scales=torch.from_numpy(np.ascontiguousarray(scales.reshape(rows, -1), dtype=dtype)),
        mins=None
        if mins is None
        else torch.from_numpy(np.ascontiguousarray(mins.reshape(rows, -1), dtype=dtype)),
        group_size=group,
        in_features=in_features,
        source_format=type_name,
    )


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte ``start`` of each block, as fp32 ``[N, blocks]``."""
    return _halves(blocks, start).astype(np.float32)


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
    """The 8 6-bit (scale, min) pairs of each super-block, from its 12 bytes."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), axis=-1)
    mn = np.concatenate((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(blocks):
    d, dmin = _half(blocks, 0)[..., None], _half(blocks, 2)[..., None]
    sc, mn = _q4_k_scales(blocks[..., 4:16])
    qs = blocks[..., 16:144].reshape(
        *blocks.shape[:2], 4, 32
    )  # 4 chunks of 64: low nibbles 0..31, high 32..63
    values = np.stack((qs & 0x0F, qs >> 4), axis=-2).reshape(*blocks.shape[:2], 8, 32)  # 8 groups of 32
    return _nibbles_to_int4(values[..., :16], values[..., 16:]), d * sc, -(dmin * mn), 32


def _q6_k(blocks):
    shape = blocks.shape[:2]
    ql = blocks[..., :128].reshape(*shape, 2, 1, 64)
    qh = blocks[..., 128:192].reshape(*shape, 2, 1, 32)
    low = np.concatenate((ql & 0x0F, ql >> 4), axis=-2).reshape(*shape, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 0x03  # [N, B, 2, 4, 32]
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)  # [N, B, 16]
    return q.reshape(*shape, _QK_K), _half(blocks, 208)[..., None] * sc, None, 16


_REPACKERS = {"Q8_0": _q8_0, "Q5_0": _q5_0, "Q6_K": _q6_k, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k}
