"""GGUF blocks repacked for the quantized matmul, against the gguf package's dequantization.

Q8_0, Q5_0, Q5_1, Q4_0 and Q4_1 blocks come from gguf's own quantize; gguf has
no quantizer for Q4_K, Q5_K and Q6_K, so their blocks are random bytes with
sane fp16 scales (every bit pattern of the quants is then exercised).

Tolerances, per format: the repacked weights equal gguf's dequantization
exactly (all formats); the layer's matmul differs from ``F.linear`` over
those weights only in the order of fp32 sums, within 1e-5 of the largest
output for these sizes (K = 512). These tests run the fp32 activations
(``WEFT_QUANT_ACTIVATIONS=fp32``, the default, set explicitly) so that bound
holds at every row count; the opt-in integer paths are checked per format in
``test_activations_setting_picks_the_decode_kernel_under_the_row_threshold``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from services.worker.distributed import TensorParallelGroup
from services.worker.gguf_repack import packable, repack
from services.worker.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    even_slices,
)
from services.worker.layers.quantized_linear import finalize_quantized
from services.worker.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

FORMATS = ["Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]
SUM_ORDER_TOLERANCE = 1e-5
# Byte offsets of the fp16 scales in the K formats' super-blocks (gguf's layout).
_K_HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@pytest.fixture(autouse=True)
def fp32_activations(monkeypatch):
    from services.worker.layers import quantized_linear

    monkeypatch.setenv("WEFT_QUANT_ACTIVATIONS", "fp32")
    monkeypatch.setattr(quantized_linear, "_KERNEL", quantized_linear._Kernel())


def gguf_blocks(fmt: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """``[rows, bytes per row]`` uint8 of ``fmt``, as GGUFReader maps a tensor."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[fmt]
    if fmt not in _K_HALVES:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block_elems, block_bytes), dtype=np.uint8)
    for offset in _K_HALVES[fmt]:
        halves = rng.uniform(0.001, 0.01, blocks.shape[:2]).astype(np.float16)
        blocks[..., offset : offset + 2] = halves[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def reference(fmt: str, data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(
        np.ascontiguousarray(dequantize(data, GGMLQuantizationType[fmt]), dtype=np.float32)
    )


def close_to(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(
        actual, expected, rtol=0, atol=SUM_ORDER_TOLERANCE * float(expected.abs().max())
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_repacked_weights_equal_gguf_dequantize(fmt):
    data = gguf_blocks(fmt, 24, 512)
    packed = repack(fmt, data, 512)
    assert packed.shape == (24, 512)
    assert torch.equal(packed.dequantize(), reference(fmt, data))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_quantized_layer_matches_the_dequantized_reference(fmt, rows):
    data = gguf_blocks(fmt, 96, 512, seed=1)
    layer = ColumnParallelLinear(512, even_slices([96], TensorParallelGroup(), ["out"]), True, torch.float32)
    layer.load_weight("weight", repack(fmt, data, 512), 0)
    bias = torch.randn(96)
    layer.load_weight("bias", bias, 0)
    finalize_quantized(layer)
    assert layer.weight is None and layer.quant is not None  # no dense copy kept
    x = torch.randn(rows, 512)
    close_to(layer(x), F.linear(x, reference(fmt, data), bias))


def test_many_rows_go_through_chunks_of_dequantized_rows(monkeypatch):
    """fp32 activations (opt-in): from GEMM_MIN_ROWS rows on, chunks of W are dequantized into one
    buffer for a float GEMM."""
    from services.worker.layers import quantized_linear

    monkeypatch.setenv("WEFT_QUANT_ACTIVATIONS", "fp32")
    monkeypatch.setattr(quantized_linear, "_KERNEL", quantized_linear._Kernel())
    monkeypatch.setattr(quantized_linear, "_CHUNK_BYTES", 4 * 512 * 10)  # 10 rows a chunk: 10 chunks
    data = gguf_blocks("Q4_K", 96, 512, seed=6)
    layer = ColumnParallelLinear(512, even_slices([96], TensorParallelGroup(), ["out"]), False, torch.float32)
    layer.load_weight("weight", repack("Q4_K", data, 512), 0)
    finalize_quantized(layer)
    x = torch.randn(quantized_linear.GEMM_MIN_ROWS, 512)
    close_to(layer(x), F.linear(x, reference("Q4_K", data)))


def test_bf16_activations_compute_in_fp32():
    data = gguf_blocks("Q4_1", 32, 256, seed=2)
    layer = ColumnParallelLinear(
        256, even_slices([32], TensorParallelGroup(), ["out"]), False, torch.bfloat16
    )
    layer.load_weight("weight", repack("Q4_1", data, 256), 0)
    finalize_quantized(layer)
    x = torch.randn(3, 256).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, F.linear(x.float(), reference("Q4_1", data)).to(torch.bfloat16))


def _fused_layer(fmts: list[str], sizes: list[int]):
    """A fused q/k/v projection over 256 columns whose parts come packed in ``fmts``; and their blocks."""
    datas = [gguf_blocks(f, n, 256, seed=i) for i, (f, n) in enumerate(zip(fmts, sizes))]
    layer = ColumnParallelLinear(
        256, even_slices(sizes, TensorParallelGroup(), ["q", "k", "v"]), False, torch.float32
    )
    for part, (fmt, data) in enumerate(zip(fmts, datas)):
        layer.load_weight("weight", repack(fmt, data, 256), part)
    finalize_quantized(layer)
    return layer, datas


@pytest.mark.parametrize(
    "fmts,runs",
    [
        (["Q4_K", "Q4_K", "Q6_K"], ["Q4_K", "Q6_K"]),
        (["Q5_K", "Q5_K", "Q6_K"], ["Q5_K", "Q6_K"]),
        (["Q4_K", "Q5_K", "Q5_K"], ["Q4_K", "Q5_K"]),  # int4 and int5: two layouts, two runs
    ],
)
def test_fused_parts_of_mixed_formats(fmts, runs):
    """Q4_K_M and Q5_K_M files mix formats inside one fused projection (q, k in Q4_K or Q5_K; v in
    Q6_K); runs of one layout are merged."""
    sizes = [64, 32, 32]
    layer, datas = _fused_layer(fmts, sizes)
    assert [p.source_format for p in layer.quant.parts] == runs
    x = torch.randn(2, 256)
    close_to(layer(x), F.linear(x, torch.cat([reference(f, d) for f, d in zip(fmts, datas)])))


@pytest.mark.parametrize("implied,stored", [("Q4_0", "Q4_1"), ("Q5_0", "Q5_1")])
def test_a_fused_layer_stores_the_implied_mins_of_its_parts_without(implied, stored):
    """Q4_0 and Q5_0 store no mins, Q4_1 and Q5_1 do: merged into one run, the former's rows get
    theirs (-8 * d, Q5_0's -16 * d)."""
    fmts, sizes = [implied, stored, implied], [32, 32, 64]
    layer, datas = _fused_layer(fmts, sizes)
    (merged,) = layer.quant.parts
    assert merged.scales.dtype == merged.mins.dtype == torch.float16
    expected = torch.cat([reference(f, d) for f, d in zip(fmts, datas)])
    assert torch.equal(merged.dequantize(), expected)
    x = torch.randn(2, 256)
    close_to(layer(x), F.linear(x, expected))


# Packed bytes per 256 weights, and the file's (the README states these ratios): Q8_0, Q5_0, Q5_1,
# Q4_0, Q4_1 and Q6_K (int6: nibbles, two high bits a weight, the 18-byte record) hold what the file
# holds; Q4_K and Q5_K 4 bytes more per super-block (their 6-bit sc and m as bytes).
PACKED_AND_FILE_BYTES = {
    "Q8_0": (272, 272),
    "Q5_0": (176, 176),
    "Q5_1": (192, 192),
    "Q4_0": (144, 144),
    "Q4_1": (160, 160),
    "Q4_K": (148, 144),
    "Q5_K": (180, 176),
    "Q6_K": (210, 210),
}


@pytest.mark.parametrize("fmt", sorted(PACKED_AND_FILE_BYTES))
def test_packed_weights_are_about_as_small_as_the_file(fmt):
    data = gguf_blocks(fmt, 24, 512)
    packed, file = PACKED_AND_FILE_BYTES[fmt]
    assert data.nbytes == file * 24 * 512 // 256
    assert repack(fmt, data, 512).nbytes == packed * 24 * 512 // 256


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K", "Q5_0", "Q5_1", "Q5_K"])
def test_rows_past_1024_groups_take_fp32_scales_and_mins(fmt):
    """Past the kernels' 1,024 groups a row (K > 32,768) the repacker stores fp32 scales and every
    min per group (Q4_0's -8 d and Q5_0's -16 d too): the same weights, which the kernels run."""
    from kernels.cpu_quant_linear import quant_linear_i8
    from kernels.reference import quant_linear_i8_ref

    k = 33024  # 1,032 groups of 32
    data = gguf_blocks(fmt, 3, k, seed=10)
    packed = repack(fmt, data, k)
    assert packed.scales.dtype == packed.mins.dtype == torch.float32 and packed.scales.dim() == 2
    assert torch.equal(packed.dequantize(), reference(fmt, data))
    x = torch.randn(2, k)
    args = (packed.qweight, packed.scales, packed.mins, packed.group_size)
    close_to(quant_linear_i8(x, *args, qhigh=packed.qhigh), quant_linear_i8_ref(x, *args, qhigh=packed.qhigh))


def test_q6_k_rows_past_1024_groups_take_fp32_scales():
    """Q6_K's groups are 16: past 1,024 a row (K > 16,384) it takes fp32 scales per group."""
    from kernels.cpu_quant_linear import quant_linear, quant_linear_i8
    from kernels.reference import quant_linear_i8_ref

    k = 16640  # 1,040 groups of 16
    data = gguf_blocks("Q6_K", 3, k, seed=10)
    packed = repack("Q6_K", data, k)
    assert (
        packed.layout == ("int6", 16, False) and packed.scales.dtype == torch.float32 and packed.mins is None
    )
    assert torch.equal(packed.dequantize(), reference("Q6_K", data))
    x = torch.randn(2, k)
    args = (packed.qweight, packed.scales, None, 16)
    close_to(quant_linear_i8(x, *args, qhigh=packed.qhigh), quant_linear_i8_ref(x, *args, qhigh=packed.qhigh))
    close_to(quant_linear(x, *args, qhigh=packed.qhigh), F.linear(x, reference("Q6_K", data)))


@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_format_columns_split_on_super_blocks_or_per_group(fmt):
    """Tensor-parallel column slices of a K format: on super-blocks they keep the records; off them
    the slice takes fp32 scales per group (the same values)."""
    data = gguf_blocks(fmt, 8, 1024, seed=9)
    packed, dense = repack(fmt, data, 1024), reference(fmt, data)
    aligned = packed.narrow(1, 256, 512)
    assert aligned.super_scales and torch.equal(aligned.dequantize(), dense[:, 256:768])
    off = packed.narrow(1, 128, 256)
    assert not off.super_scales and off.scales.dtype == torch.float32
    assert torch.equal(off.dequantize(), dense[:, 128:384])


def test_q5_k_fifth_bits_are_the_files_as_bit_planes():
    """Q5_K's qh (bit g of byte j: element j of group g of the super-block) becomes bit planes in the
    order the super-block path unpacks a pair of groups; decoded, they are the file's fifth bits."""
    from kernels.reference import packed_values

    data = gguf_blocks("Q5_K", 6, 768, seed=12)
    packed = repack("Q5_K", data, 768)
    qh = torch.from_numpy(data.reshape(6, 3, 176)[..., 16:48].copy())  # [N, B, 32]
    bits = torch.arange(8, dtype=torch.uint8)[:, None]
    files = ((qh[:, :, None, :] >> bits) & 1).flatten(1, 2)  # [N, groups, 32]: element j of group g
    values = packed_values(packed.qweight, 32, packed.qhigh, planes=True)
    assert torch.equal(values >> 4, files)
    assert torch.equal(packed.dequantize(), reference("Q5_K", data))


def test_q5_k_planes_and_per_group_words_run_the_same_weights():
    """Every path over a Q5_K weight against gguf's dequantization: its records and bit planes
    (the int8 super-block path, int16, the twin), and the per-group words they become with fp32
    scales (a tensor-parallel slice off super-blocks, the fp32 activations)."""
    from kernels.cpu_quant_linear import quant_linear, quant_linear_i8, quant_linear_i16
    from kernels.reference import quant_linear_i8_ref

    data = gguf_blocks("Q5_K", 40, 1024, seed=13)
    packed, dense = repack("Q5_K", data, 1024), reference("Q5_K", data)
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(3))
    per_group = packed.with_fp32_scales()
    assert per_group.scales.dim() == 2 and not torch.equal(per_group.qhigh, packed.qhigh)
    assert torch.equal(per_group.dequantize(), dense)
    records = (packed.qweight, packed.scales, None, 32)
    fp32 = (per_group.qweight, per_group.scales, per_group.mins, 32)
    close_to(quant_linear(x, *fp32, qhigh=per_group.qhigh), F.linear(x, dense))
    close_to(
        quant_linear_i8(x, *records, qhigh=packed.qhigh), quant_linear_i8_ref(x, *records, qhigh=packed.qhigh)
    )
    assert torch.equal(
        quant_linear_i16(x, *records, qhigh=packed.qhigh), quant_linear_i16(x, *fp32, qhigh=per_group.qhigh)
    )
    on = packed.narrow(1, 256, 512).contiguous()  # on super-blocks: the records and their planes
    xs = x[:, 256:768].contiguous()
    assert on.super_scales and torch.equal(on.dequantize(), dense[:, 256:768])
    sliced = (on.qweight, on.scales, None, 32)
    close_to(quant_linear_i8(xs, *sliced, qhigh=on.qhigh), quant_linear_i8_ref(xs, *sliced, qhigh=on.qhigh))
    off = packed.narrow(1, 96, 512).contiguous()  # off super-blocks: fp32 scales, per-group words
    assert torch.equal(off.dequantize(), dense[:, 96:608])
    xo = x[:, 96:608].contiguous()
    close_to(
        quant_linear(xo, off.qweight, off.scales, off.mins, 32, qhigh=off.qhigh),
        F.linear(xo, dense[:, 96:608]),
    )


def test_q6_k_columns_off_128_take_the_int8_layout():
    """int6 holds Q6_K's bits per 128 columns: a slice on them stays int6, one off them (a
    tensor-parallel rank of 64 columns) takes the int8 layout, q - 32 a byte; the same weights."""
    data = gguf_blocks("Q6_K", 8, 1024, seed=11)
    packed, dense = repack("Q6_K", data, 1024), reference("Q6_K", data)
    on = packed.narrow(1, 384, 128)
    assert on.layout == ("int6", 16, False) and torch.equal(on.dequantize(), dense[:, 384:512])
    off = packed.narrow(1, 64, 64)
    assert off.layout == ("int8", 16, False) and torch.equal(off.dequantize(), dense[:, 64:128])


def test_a_packed_weight_of_the_wrong_width_is_refused():
    layer = ColumnParallelLinear(128, even_slices([32], TensorParallelGroup(), ["out"]), False, torch.float32)
    layer.load_weight("weight", repack("Q8_0", gguf_blocks("Q8_0", 32, 64), 64), 0)
    with pytest.raises(ValueError, match="do not fit"):
        finalize_quantized(layer)


def test_a_fused_layer_with_an_unpacked_part_runs_dense():
    q = gguf_blocks("Q8_0", 32, 64)
    layer = ColumnParallelLinear(
        64, even_slices([32, 32], TensorParallelGroup(), ["a", "b"]), False, torch.float32
    )
    layer.load_weight("weight", repack("Q8_0", q, 64), 0)
    dense = torch.randn(32, 64)
    layer.load_weight("weight", dense, 1)  # e.g. an F16 part, dequantized at load
    finalize_quantized(layer)
    assert layer.quant is None
    assert torch.equal(layer.weight, torch.cat([reference("Q8_0", q), dense]))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_tensor_parallel_slices_of_packed_weights(world_size):
    """Column-parallel keeps output rows, row-parallel group-aligned input columns; the
    ranks' outputs put together equal the whole layer."""
    up_data, down_data = gguf_blocks("Q4_1", 256, 128, seed=3), gguf_blocks("Q6_K", 128, 256, seed=4)
    x = torch.randn(3, 128)
    hidden = F.linear(x, reference("Q4_1", up_data))
    expected = F.linear(hidden, reference("Q6_K", down_data))
    pieces, partial_sums = [], []
    for rank in range(world_size):
        tp = TensorParallelGroup(rank=rank, world_size=world_size)
        up = ColumnParallelLinear(128, even_slices([256], tp, ["up"]), False, torch.float32)
        up.load_weight("weight", repack("Q4_1", up_data, 128), 0)
        down = RowParallelLinear(256, 128, False, torch.float32, tp)
        down.load_weight("weight", repack("Q6_K", down_data, 256), None)
        finalize_quantized(up)
        finalize_quantized(down)
        pieces.append(up(x))
        partial_sums.append(down.linear(pieces[-1], None))  # forward() would all-reduce these
    close_to(torch.cat(pieces, dim=-1), hidden)
    close_to(sum(partial_sums), expected)


def test_misaligned_tensor_parallel_columns_are_refused():
    down = RowParallelLinear(
        96, 8, False, torch.float32, TensorParallelGroup(rank=0, world_size=2)
    )  # 48 columns
    with pytest.raises(ValueError, match="--quantization none"):
        down.load_weight("weight", repack("Q8_0", gguf_blocks("Q8_0", 8, 96), 96), None)


@pytest.mark.parametrize(
    "fmt,world_size", [("Q8_0", 1), ("Q8_0", 3), ("Q5_K", 1), ("Q5_0", 3), ("Q6_K", 1), ("Q6_K", 3)]
)
def test_packed_embedding_and_tied_head(fmt, world_size):
    vocab, dim = 50, 256
    data = gguf_blocks(fmt, vocab, dim, seed=5)
    table = reference(fmt, data)
    ids = torch.tensor([0, vocab - 1, 3, 17])
    hidden = torch.randn(2, dim)
    for rank in range(world_size):
        tp = TensorParallelGroup(rank=rank, world_size=world_size)
        embedding = VocabParallelEmbedding(vocab, dim, torch.float32, tp)
        head = ParallelLMHead(vocab, dim, torch.float32, tp, tied_to=embedding)
        embedding.load_weight("weight", repack(fmt, data, dim), None)
        model = torch.nn.ModuleDict({"embed": embedding, "head": head})
        finalize_quantized(model)
        assert head.quant is embedding.quant and embedding.weight is None and head.weight is None
        shard = embedding.shard
        local = head.linear(hidden, None)  # this rank's rows of the logits, padding rows zero
        assert local.shape == (2, shard.rows_per_rank)
        close_to(
            local[:, : shard.num_rows], F.linear(hidden, table[shard.start : shard.start + shard.num_rows])
        )
        assert (local[:, shard.num_rows :] == 0).all()
        if world_size == 1:
            assert torch.equal(embedding(ids), F.embedding(ids, table))


def test_only_formats_with_a_layout_are_packed():
    assert all(packable(f) for f in FORMATS)
    assert not any(packable(f) for f in ("F32", "F16", "BF16", "Q2_K", "Q3_K"))


def test_without_the_kernel_the_torch_twin_runs_and_says_why(monkeypatch, caplog):
    from kernels import cpu_quant_linear
    from services.worker.layers import quantized_linear

    def unavailable(isa=None):
        raise cpu_quant_linear.KernelUnavailable("no compiler here")

    monkeypatch.setattr(cpu_quant_linear, "load", unavailable)
    monkeypatch.setattr(quantized_linear, "_KERNEL", quantized_linear._Kernel())
    data = gguf_blocks("Q5_0", 16, 64, seed=7)
    layer = ColumnParallelLinear(64, even_slices([16], TensorParallelGroup(), ["out"]), False, torch.float32)
    layer.load_weight("weight", repack("Q5_0", data, 64), 0)
    finalize_quantized(layer)
    x = torch.randn(2, 64)
    with caplog.at_level("WARNING"):
        close_to(layer(x), F.linear(x, reference("Q5_0", data)))
    assert "no compiler here" in caplog.text


@pytest.mark.parametrize("fmt", FORMATS)
def test_activations_setting_picks_the_kernel_at_every_row_count(monkeypatch, fmt):
    """WEFT_QUANT_ACTIVATIONS: the int8 or int16 kernel (their twin's numbers; unset means int8)
    at every row count, so a row's result has the same bits whatever rows share its step; or fp32."""
    from kernels.reference import quant_linear_i8_ref
    from services.worker.layers import quantized_linear

    data = gguf_blocks(fmt, 96, 512, seed=8)
    layer = ColumnParallelLinear(512, even_slices([96], TensorParallelGroup(), ["out"]), False, torch.float32)
    layer.load_weight("weight", repack(fmt, data, 512), 0)
    finalize_quantized(layer)
    (part,) = layer.quant.parts
    few, many = torch.randn(7, 512), torch.randn(300, 512)
    packed = (part.qweight, part.scales, part.mins, part.group_size)
    assert (part.qhigh is not None) == fmt.startswith(("Q5", "Q6"))  # the int5 and int6 layouts
    dense = reference(fmt, data)
    for activations, dtype in (
        ("int8", torch.int8),
        ("int16", torch.int16),
        ("", torch.int8),
        ("fp32", None),
    ):
        monkeypatch.setenv("WEFT_QUANT_ACTIVATIONS", activations)
        monkeypatch.setattr(quantized_linear, "_KERNEL", quantized_linear._Kernel())
        if dtype is None:
            close_to(layer(few), F.linear(few, dense))
            close_to(layer(many), F.linear(many, dense))
            continue
        close_to(layer(few), quant_linear_i8_ref(few, *packed, dtype, qhigh=part.qhigh))
        close_to(layer(many), quant_linear_i8_ref(many, *packed, dtype, qhigh=part.qhigh))
        # The few rows inside a batch of many give the same bits as alone.
        assert torch.equal(layer(torch.cat((few, many)))[: len(few)], layer(few))


def test_a_bad_activations_setting_is_refused_by_name(monkeypatch):
    from services.worker.layers import quantized_linear

    monkeypatch.setenv("WEFT_QUANT_ACTIVATIONS", "int4")
    with pytest.raises(
        ValueError, match="WEFT_QUANT_ACTIVATIONS must be one of int8, int16, fp32, got 'int4'"
    ):
        quantized_linear.activations_from_env()
    with pytest.raises(ValueError, match="activations must be one of"):
        quantized_linear.choose_kernel(None, "bf16")
