"""Q4_K, Q5_K and Q6_K quantizers for ``weft bench make-model`` (the ``gguf`` package only reads these).

Round to nearest, no search: each group's scale (and for Q4_K/Q5_K its min) is taken from the
group's range, the super-block's fp16 ``d`` (and ``dmin``) from the largest of them, the 6-bit
(Q6_K: 8-bit signed) group scales rounded against the fp16 value, and every weight rounded against
the scale it will be read with. llama.cpp's quantizer searches for better scales; for random weights
that only lowers the error a little, and the blocks are laid out exactly as llama.cpp's (the
``gguf`` package's ``dequantize`` reads them back: tests/bench/test_kquants.py).

Blocks of 256 weights:
- Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of
  nibbles: bytes 32c..32c+31 hold group 2c in their low nibbles and group 2c+1 in their high ones.
  Weight = d * sc * q - dmin * m, q in [0, 16).
- Q5_K (176 bytes): Q4_K's d, dmin and scales, 32 bytes of fifth bits (bit i of byte j: element j
  of group i), then Q4_K's 128 bytes of nibbles. q in [0, 32).
- Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16
  weights), fp16 d. Weight = d * sc * (q - 32), q in [0, 64).
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def quantize(rows: np.ndarray, type_name: str) -> np.ndarray:
    """``rows [n, k]`` fp32, ``k`` a multiple of 256 -> ``[n, k / 256 * block bytes]`` uint8."""
    rows = np.asarray(rows, dtype=np.float32)
    n, k = rows.shape
    if k % QK_K:
        raise ValueError(f"{type_name} needs rows of a multiple of {QK_K} values, got {k}.")
    blocks = rows.reshape(n * k // QK_K, QK_K)
    packed = _QUANTIZERS[type_name](blocks)
    return packed.reshape(n, -1)


def _half(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x`` as fp16 (its bytes, [..., 2] uint8) and as the fp32 value those bytes read back as."""
    h = x.astype(np.float16)
    return h.reshape(*h.shape, 1).view(np.uint8), h.astype(np.float32)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, 0 where b is 0 (an all-zero group)."""
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def _scales_and_mins(blocks: np.ndarray, levels: int):
    """Q4_K/Q5_K: each block's 8 groups of 32 -> (q [B, 8, 32], d and dmin bytes, sc, m)."""
    groups = blocks.reshape(-1, 8, 32)
    low = np.minimum(groups.min(axis=-1), 0)  # a min is subtracted, so it is never positive
    scale = (groups.max(axis=-1) - low) / (levels - 1)
    d_bytes, d = _half(scale.max(axis=-1) / 63)
    dmin_bytes, dmin = _half(-low.min(axis=-1) / 63)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_ratio(-low, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None] * sc  # the scale and min each group is read with
    offset = dmin[:, None] * m
    q = np.clip(np.rint(_ratio(groups + offset[..., None], step[..., None])), 0, levels - 1).astype(np.uint8)
    return q, d_bytes, dmin_bytes, _pack_scales(sc, m)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit (scale, min) pairs -> 12 bytes: bytes 0-3 and 4-7 the first four scales and mins
    with the top two bits of the last four in their high bits, bytes 8-11 the last four's low nibbles."""
    first_sc, last_sc, first_m, last_m = sc[:, :4], sc[:, 4:], m[:, :4], m[:, 4:]
    return np.concatenate(
        (
            first_sc | ((last_sc >> 4) << 6),
            first_m | ((last_m >> 4) << 6),
            (last_sc & 0x0F) | ((last_m & 0x0F) << 4),
        ),
        axis=-1,
    ).astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """q [B, 8, 32] -> 128 bytes: groups 2c and 2c + 1 share bytes 32c..32c+31, low and high nibble."""
    pairs = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    q, d, dmin, scales = _scales_and_mins(blocks, 16)
    return np.concatenate((d, dmin, scales, _nibbles(q)), axis=-1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    q, d, dmin, scales = _scales_and_mins(blocks, 32)
    fifth = (q >> 4).astype(np.uint8)  # [B, 8, 32]: bit i of byte j is element j of group i
    qh = np.bitwise_or.reduce(fifth << np.arange(8, dtype=np.uint8)[:, None], axis=1)
    return np.concatenate((d, dmin, scales, qh, _nibbles(q)), axis=-1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    groups = blocks.reshape(-1, 16, 16)
    scale = np.abs(groups).max(axis=-1) / 31  # q - 32 in [-32, 31]: symmetric, so +-31 steps
    d_bytes, d = _half(scale.max(axis=-1) / 127)
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), -128, 127).astype(np.int8)
    step = d[:, None] * sc
    q = (np.clip(np.rint(_ratio(groups, step[..., None])), -32, 31) + 32).astype(np.uint8)
    # Element 128h + 32r + j (h: half, r in 0..3, j in 0..31): low nibble in byte 64h + 32(r % 2) + j
    # (r < 2) or its high nibble (r >= 2); its top two bits at bits 2r of byte 128 + 32h + j.
    q = q.reshape(-1, 2, 4, 32)
    low, top = q & 0x0F, q >> 4
    ql = (low[:, :, :2] | (low[:, :, 2:] << 4)).reshape(-1, 128)
    qh = (top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate((ql, qh, sc.view(np.uint8), d_bytes), axis=-1)


_QUANTIZERS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
TYPES = tuple(_QUANTIZERS)
