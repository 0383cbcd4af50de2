"""GGUF quantized blocks -> the packed layouts of ``PackedWeight``, without going through fp32.

| GGUF   | block            | packed as                                           | bytes/param | x file |
|--------|------------------|-----------------------------------------------------|-------------|--------|
| Q8_0   | 32: d, 32 x int8 | int8, scale d (fp16) per 32                         | 1.0625      | 1.0    |
| Q6_K   | 256: 16 x 16     | int6 q, w = d sc (q - 32); per 256 d (fp16), 16 x int8 sc | 0.8203 | 1.0    |
| Q5_0   | 32: d, 5-bit q   | int5 q, scale d (fp16) per 32, min -16 d implied    | 0.6875      | 1.0    |
| Q5_1   | 32: d, m, 5-bit q| int5 q, scale d, min m (fp16) per 32                | 0.75        | 1.0    |
| Q5_K   | 256: 8 x 32      | int5 q; per 256 d, dmin (fp16), 8 x uint8 sc and m  | 0.7031      | 1.02   |
| Q4_0   | 32: d, 4-bit q   | int4 q, scale d (fp16) per 32, min -8 d implied     | 0.5625      | 1.0    |
| Q4_1   | 32: d, m, 4-bit q| int4 q, scale d, min m (fp16) per 32                | 0.625       | 1.0    |
| Q4_K   | 256: 8 x 32      | int4 q; per 256 d, dmin (fp16), 8 x uint8 sc and m  | 0.5781      | 1.03   |

int5 is int4 plus ``qhigh``, the fifth bits (a uint32 per group of 32, bit
``j`` element ``j``'s): Q5_0's and Q5_1's nibbles and ``qh`` go in as the
file holds them; Q5_K's ``qh`` (bit ``i`` of byte ``j`` is element ``j`` of
group ``i`` of the super-block) becomes 32 bytes of bit planes a super-block
in the order its super-block path unpacks them (``_fifth_bit_planes``; the
fp32-scale fallback turns them into per-group words). int6 (Q6_K) is the
file's ``ql`` (low four bits, ``qweight``) and ``qh`` (two high bits a
weight, ``qhigh``) as they are (``kernels.reference.packed_values`` gives
the order); its 210 bytes per 256 are the file's (the int8 layout held 274).
The 32-element formats keep their blocks' own fp16 ``d`` (and ``m``; Q4_0
and Q5_0 store none, the kernels form ``-8 d`` or ``-16 d`` in fp32 as they
read ``d``). The K
formats keep a record per super-block of 256 (``scales [N, K / 256, 20 or
18]`` uint8: ``kernels.reference.super_scales_ref``): the block's halves and
its groups' 6-bit scales and mins a byte each, whose products ``d * sc`` and
``-(dmin * m)`` the kernels form in fp32, exactly (a half times an integer
under 2^8). Past 1,024 groups a row (K > 32,768 at 32 a group) every format
takes fp32 scales and mins per group instead (the kernels' bound). Either way the
packed weights rebuild the gguf package's dequantization bit for bit. Other
types (F16, BF16, Q2_K, Q3_K, ...) have no packed layout here and are
dequantized at load.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from kernels import cpu_fused
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
    qweight, scales, mins, group, qhigh = _REPACKERS[type_name](blocks)
    qweight = torch.from_numpy(np.ascontiguousarray(qweight.reshape(rows, -1)))
    if qhigh is not None:
        qhigh = torch.from_numpy(np.ascontiguousarray(qhigh.reshape(rows, -1)))
    # The kernels read fp16 scales, implied mins and the K formats' records up to 1,024 groups a row
    # (cpu_quant_linear.cpp, RowScales); past that, fp32 scales and mins per group.
    compact = in_features // group <= _MAX_HALF_GROUPS
    if scales.dtype == np.uint8:  # the K formats' records, [N, blocks, bytes]
        packed = PackedWeight(
            qweight,
            torch.from_numpy(np.ascontiguousarray(scales)),
            None,
            group,
            in_features,
            type_name,
            qhigh,
        )
        return packed if compact else packed.with_fp32_scales()
    scales = torch.from_numpy(np.ascontiguousarray(scales.reshape(rows, -1)))
    mins = None if mins is None else torch.from_numpy(np.ascontiguousarray(mins.reshape(rows, -1)))
    if not compact:
        scales, mins = group_scales(qweight, scales, mins, group, qhigh)
    return PackedWeight(qweight, scales, mins, group, in_features, type_name, qhigh)


def _halves(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte ``start`` of each block, ``[N, blocks]`` fp16."""
    return _quants(blocks, start, start + 2).view("<f2")[..., 0]


def _quants(blocks: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Bytes ``[start, stop)`` of each block, ``[N, blocks, stop - start]`` uint8, contiguous: in one
    compiled pass (``kernels/csrc/gguf_repack.cpp``) where the fused CPU kernels build, else by the
    numpy twin."""
    if not cpu_fused.available():
        return quants_ref(blocks, start, stop)
    out = np.empty((*blocks.shape[:2], stop - start), np.uint8)
    cpu_fused.block_bytes(torch.from_numpy(out), _as_tensor(blocks), start, stop)
    return out


def quants_ref(blocks: np.ndarray, start: int, stop: int) -> np.ndarray:
    """The numpy twin of ``_quants``.

    Copied as one ``stop - start``-byte item per block: numpy copies a strided byte slice a byte
    at a time, several times slower, and a 1B model's load copies 600 MB this way."""
    items = np.ascontiguousarray(_field(blocks, start, f"V{stop - start}"))
    return items.view(np.uint8).reshape(*blocks.shape[:2], stop - start)


def _as_tensor(blocks: np.ndarray) -> torch.Tensor:
    """``blocks`` as a contiguous uint8 tensor for the compiled repack, without a copy where it is
    contiguous already (the GGUF map is)."""
    blocks = np.ascontiguousarray(blocks)
    with warnings.catch_warnings():
        # The file's map is read-only and torch warns of a non-writable array; the ops only read it.
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        return torch.from_numpy(blocks)


def _field(blocks: np.ndarray, start: int, dtype: str) -> np.ndarray:
    """The ``dtype`` item at byte ``start`` of each block, ``[N, blocks]``, a view of ``blocks``."""
    if not blocks.flags.c_contiguous:
        blocks = np.ascontiguousarray(blocks)
    record = np.dtype({"names": ["f"], "formats": [dtype], "offsets": [start], "itemsize": blocks.shape[-1]})
    return blocks.view(record)[..., 0]["f"]


# Each repacker: (qweight, scales, mins, group, qhigh) from the blocks [N, B, bytes]; qhigh for int5 and int6.


def _q8_0(blocks):
    return _quants(blocks, 2, 34).view(np.int8), _halves(blocks, 0), None, 32, None


def _q5_0(blocks):
    # qh (bit j: element j's fifth bit) and qs (Q4_0's nibble order) as they are; no mins: the kernels
    # take each as -16 d (exact in fp32).
    return _quants(blocks, 6, 22), _halves(blocks, 0), None, 32, _quants(blocks, 2, 6)


def _q5_1(blocks):
    return _quants(blocks, 8, 24), _halves(blocks, 0), _halves(blocks, 2), 32, _quants(blocks, 4, 8)


def _q4_0(blocks):
    # No mins: the kernels take each as -8 d (exact in fp32), so none are stored.
    return _quants(blocks, 2, 18), _halves(blocks, 0), None, 32, None


def _q4_1(blocks):
    return _quants(blocks, 4, 20), _halves(blocks, 0), _halves(blocks, 2), 32, None


def _k_records_and_nibbles(blocks: np.ndarray, qs_start: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 20-byte records (d, dmin fp16, 8 sc, 8 m) and their 128 bytes of low nibbles
    from ``qs_start`` in weft's int4 order, ``[N, B, 8, 16]``: in one compiled pass
    (``kernels/csrc/gguf_repack.cpp``) where the fused CPU kernels build, else by the numpy twin."""
    if not cpu_fused.available():
        return k_records_and_nibbles_ref(blocks, qs_start)
    records = np.empty((*blocks.shape[:2], 20), np.uint8)
    nibbles = np.empty((*blocks.shape[:2], 8, 16), np.uint8)
    cpu_fused.k_records_and_nibbles(
        torch.from_numpy(records), torch.from_numpy(nibbles), _as_tensor(blocks), qs_start
    )
    return records, nibbles


def k_records_and_nibbles_ref(blocks: np.ndarray, qs_start: int) -> tuple[np.ndarray, np.ndarray]:
    """The numpy twin of ``_k_records_and_nibbles``.

    Every field moves within its byte, so the work goes four or eight bytes to an integer: numpy's
    byte-wide operations over short rows cost several times more (a 1B model repacks 450 MB)."""
    # The 12 bytes of 6-bit (scale, min) pairs, as words d, m, md (a byte a group, groups 0-3):
    # scales 0-3 are d's low six bits, 4-7 md's low nibbles under d's top two; mins likewise from m
    # and md's high nibbles.
    d, m, md = (_field(blocks, start, "<u4") for start in (4, 8, 12))
    six, nibble, top = np.uint32(0x3F3F3F3F), np.uint32(0x0F0F0F0F), np.uint32(0x30303030)
    records = np.empty((*blocks.shape[:2], 5), np.uint32)
    records[..., 0] = _field(blocks, 0, "<u4")  # d and dmin
    records[..., 1] = d & six
    records[..., 2] = (md & nibble) | ((d >> np.uint32(2)) & top)
    records[..., 3] = m & six
    records[..., 4] = ((md >> np.uint32(4)) & nibble) | ((m >> np.uint32(2)) & top)
    # 4 chunks of 32 bytes: chunk c holds group 2c in its low nibbles and group 2c + 1 in its high
    # ones, element j in byte j. weft's byte j of a group: element j low, element j + 16 high. So
    # each group's bytes come from the chunk's halves a (bytes 0-15) and b (16-31), a nibble moved.
    qs = quants_ref(blocks, qs_start, qs_start + 128).view("<u8").reshape(*blocks.shape[:2], 4, 2, 2)
    a, b = qs[..., 0, :], qs[..., 1, :]
    low, high = np.uint64(0x0F0F0F0F0F0F0F0F), np.uint64(0xF0F0F0F0F0F0F0F0)
    groups = np.empty((*blocks.shape[:2], 4, 2, 2), np.uint64)
    groups[..., 0, :] = (a & low) | ((b << np.uint64(4)) & high)  # group 2c
    groups[..., 1, :] = ((a >> np.uint64(4)) & low) | (b & high)  # group 2c + 1
    return records.view(np.uint8), groups.view(np.uint8).reshape(*blocks.shape[:2], 8, 16)


def _q4_k(blocks):
    records, nibbles = _k_records_and_nibbles(blocks, 16)
    return nibbles, records, None, 32, None


def _q5_k(blocks):
    records, nibbles = _k_records_and_nibbles(blocks, 48)
    return nibbles, records, None, 32, _fifth_bit_planes(_quants(blocks, 16, 48))


def _fifth_bit_planes(qh: np.ndarray) -> np.ndarray:
    """Q5_K's ``qh [N, B, 32]`` (bit g of byte j: element j of group g) -> ``[N, B, 32]``, the bit
    planes its super-block path reads (``kernels.reference.packed_values``): byte i holds, for each
    pair of groups (2p, 2p + 1), the fifth bit of element i of 2p (i < 16) or i - 16 of 2p + 1 in bit
    2p and of the element 16 further in bit 2p + 1.

    With a = bytes 0-15 and b = 16-31: bytes 0-15 are a's even bits and b's even bits moved up one,
    16-31 a's odd bits moved down one and b's odd bits. Every bit stays in its byte, so the work
    goes eight bytes to an integer."""
    words = qh.view("<u8")  # [N, B, 4]: a in words 0-1, b in 2-3
    a, b = words[..., :2], words[..., 2:]
    even, odd, one = np.uint64(0x5555555555555555), np.uint64(0xAAAAAAAAAAAAAAAA), np.uint64(1)
    planes = np.empty_like(words)
    planes[..., :2] = (a & even) | ((b & even) << one)
    planes[..., 2:] = ((a & odd) >> one) | (b & odd)
    return planes.view(np.uint8)


def _q6_k(blocks):
    # ql and qh as the file holds them (int6: the kernels unpack 128 weights at a time, as ggml does).
    records = np.concatenate((blocks[..., 208:210], blocks[..., 192:208]), axis=-1)  # d (fp16), 16 int8 sc
    return _quants(blocks, 0, 128), records, None, 16, _quants(blocks, 128, 192)


_REPACKERS = {
    "Q8_0": _q8_0,
    "Q6_K": _q6_k,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q5_K": _q5_k,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q4_K": _q4_k,
}
