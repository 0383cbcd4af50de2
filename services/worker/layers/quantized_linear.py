"""Weights kept packed in 8, 6, 5 or 4 bits, and the linear layers and embeddings over them.

A ``PackedWeight`` is one checkpoint matrix ``[N, K]`` in one of the four
layouts of ``kernels/csrc/cpu_quant_linear.cpp``: int8 with a scale per
group of 16 or 32 columns, int4 (two per byte) with a scale and min per
group of 32 (Q4_0 stores no mins: each is -8 times its scale), int5, int4
plus a plane of fifth bits (``qhigh``, a bit a weight; Q5_0 stores no mins:
each is -16 times its scale), or int6 (Q6_K's), int4's bytes plus two high
bits a weight in ``qhigh``, a scale per group of 16 and ``w = (q - 32) s``; scales and
mins in fp16 where they are the GGUF blocks' own; for the K formats a
record per super-block of 256 weights of the block's fp16 ``d`` (and
``dmin``) and its groups' 8-bit scales (and mins), whose products the
kernels form (``kernels.reference.super_scales_ref``). ``services.worker.gguf_repack`` makes them from GGUF blocks.

It looks like a checkpoint tensor to the layers (``shape`` and ``narrow``),
so tensor parallelism slices it as it slices a dense one: output rows freely,
input columns only on group boundaries (else a ValueError says to run with
``--quantization none``). Layers collect the packed parts they load in
``packed_parts``; ``finalize_quantized`` then turns them into the layer's
``quant`` (a ``QuantizedWeight``) and drops the dense parameter.

Numerics: the weights the kernel rebuilds equal the gguf package's
dequantization exactly. Activations (``WEFT_QUANT_ACTIVATIONS``): by default
(``int8``, as llama.cpp does it) x is rounded per weight group to int8 (one
scale amax / 127 per group), and each group is an integer dot product times
the two scales, at every row count (against the K formats' records x is rounded
per super-block of 256 and a super-block's groups summed in integers, as
llama.cpp's Q8_K): a mean NLL cost of +0.004 nats on the
default model against its dequantized weights (benchmarks/scripts/copy_likelihood.py).
One kernel at every row count, whose sums for
one (row, weight row) pair run in one fixed order whatever the other rows
are, makes the layer **batch invariant**: a row's output has the same bits
alone, beside 63 other requests, in a prefill chunk or in a speculative
verify step. So greedy outputs do not depend on what shares a step, and
n-gram speculation is token-identical to plain decoding
(tests/test_batch_invariance.py). ``int16`` (x rounded to int16: an error of
at most amax / 65534 per element, NLL +0.0000, about half int8's speed) is
invariant too and opt-in. ``fp32`` keeps x as is (the
fp32 kernels, and a float GEMM from ``GEMM_MIN_ROWS`` rows: a row's result
then depends on the batch in the order of its fp32 sums); opt-in.
Without a compiler the torch twin of the fp32 path runs at every size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from kernels.reference import (
    SUPER_BLOCK,
    dequantize_packed_ref,
    fifth_bits_per_group,
    group_scales,
    int4_mins,
    packed_values,
    quant_linear_ref,
)
from services import env
from services.config.dense_copy import DEFAULT_DENSE_MIN_ROWS
from services.worker.layers.int8_linear import Int8Weight, int8_copy_runs_here

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackedWeight:
    """``[N, K]`` packed: int8 ``qweight [N, K]``, or int4 ``qweight [N, K / 2]`` uint8 (int5 with
    ``qhigh``; int6 with ``qhigh`` and groups of 16)."""

    qweight: torch.Tensor
    # [N, K / group_size] fp32, or fp16 where they are the GGUF blocks' own; the K formats' records,
    # [N, K / 256, bytes] uint8 (super_scales_ref), mins inside
    scales: torch.Tensor
    # like 2-D scales (int4 and int5 only; None there: -8 * scales, Q4_0's, or int5's -16 * scales, Q5_0's)
    mins: torch.Tensor | None
    group_size: int
    in_features: int
    source_format: str  # the GGUF type it came from, for reports
    # int5: [N, K / 8] uint8, per group of 32 a little-endian uint32 whose bit j adds 16 to element j
    # (with records, Q5_K: 32 bytes of bit planes a super-block, kernels.reference.packed_values);
    # int6: [N, K / 4] uint8, two high bits a weight, as Q6_K holds them (kernels.reference.packed_values)
    qhigh: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], self.in_features)

    @property
    def int4(self) -> bool:
        """Two weights a byte of ``qweight`` (int4, int5 or int6), else one."""
        return self.qweight.shape[1] * 2 == self.in_features

    @property
    def int6(self) -> bool:
        return self.int4 and self.group_size == 16

    @property
    def nbytes(self) -> int:
        tensors = (self.qweight, self.scales, self.mins, self.qhigh)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def super_scales(self) -> bool:
        """Scales as the K formats' records per super-block of 256 weights."""
        return self.scales.dim() == 3

    @property
    def layout(self) -> tuple[str, int, bool]:
        kind = "int6" if self.int6 else "int5" if self.qhigh is not None else "int4" if self.int4 else "int8"
        return (kind, self.group_size, self.super_scales)

    def narrow(self, dim: int, start: int, length: int) -> PackedWeight:
        """Rows (dim 0) or group-aligned columns (dim 1) ``[start, start + length)``."""
        if dim == 0:
            return self._map_rows(lambda t: t.narrow(0, start, length))
        if self.super_scales and (start % SUPER_BLOCK or length % SUPER_BLOCK):
            # Not on super-blocks: the slice takes its scales per group (fp32, the same values).
            return self.with_fp32_scales().narrow(dim, start, length)
        if self.int6 and (start % 128 or length % 128):
            # int6 holds its bits per 128 columns: a slice off them takes the int8 layout (the same weights).
            return self.as_int8().narrow(dim, start, length)
        unit = SUPER_BLOCK if self.super_scales else self.group_size  # columns an entry of scales covers
        if start % unit or length % unit:
            raise ValueError(
                f"columns [{start}, {start + length}) of a {self.source_format} weight do not fall on its "
                f"{unit}-column blocks, so it cannot be split this way over tensor-parallel ranks; "
                "run with --quantization none to dequantize it."
            )
        per_byte = 2 if self.int4 else 1
        per_high_byte = 4 if self.int6 else 8  # columns a byte of qhigh covers
        first, count = start // unit, length // unit
        return replace(
            self,
            qweight=self.qweight.narrow(1, start // per_byte, length // per_byte),
            scales=self.scales.narrow(1, first, count),
            mins=None if self.mins is None else self.mins.narrow(1, first, count),
            qhigh=None
            if self.qhigh is None
            else self.qhigh.narrow(1, start // per_high_byte, length // per_high_byte),
            in_features=length,
        )

    def pad_rows(self, rows: int) -> PackedWeight:
        """``rows`` rows, the added ones all zero weights."""
        extra = rows - self.shape[0]
        if extra <= 0:
            return self
        return self._map_rows(lambda t: torch.cat((t, t.new_zeros(extra, *t.shape[1:]))))

    def contiguous(self) -> PackedWeight:
        return self._map_rows(lambda t: t.contiguous())

    def with_fp32_scales(self) -> PackedWeight:
        """This weight with fp32 scales and mins per group (the same values: fp16 converts exactly, the
        K formats' products are exact; Q4_0's and Q5_0's implied mins stay implied), Q5_K's fifth bits
        per group (the bit planes are its records' layout)."""
        if self.scales.dtype == torch.float32:
            return self
        scales, mins = group_scales(self.qweight, self.scales, self.mins, self.group_size, self.qhigh)
        qhigh = self.qhigh
        if self.super_scales and self.layout[0] == "int5":
            qhigh = fifth_bits_per_group(qhigh)
        return replace(
            self,
            scales=scales,
            mins=None if self.mins is None and not self.super_scales else mins,
            qhigh=qhigh,
        )

    def as_int8(self) -> PackedWeight:
        """An int6 weight in the int8 layout, ``q - 32`` a byte (the same weights, 1.3x the bytes)."""
        values = packed_values(self.qweight, self.group_size, self.qhigh).flatten(1)
        return replace(self.with_fp32_scales(), qweight=values, qhigh=None)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight ``[N, K]`` (the torch twin)."""
        return dequantize_packed_ref(self.qweight, self.scales, self.mins, self.group_size, self.qhigh)

    def _map_rows(self, fn) -> PackedWeight:
        mins = None if self.mins is None else fn(self.mins)
        qhigh = None if self.qhigh is None else fn(self.qhigh)
        return replace(self, qweight=fn(self.qweight), scales=fn(self.scales), mins=mins, qhigh=qhigh)


def cat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Parts of one layout stacked by rows."""
    scales, mins = _stacked_scales(parts)
    return replace(
        parts[0],
        qweight=torch.cat([p.qweight for p in parts]),
        scales=scales,
        mins=mins,
        qhigh=None if parts[0].qhigh is None else torch.cat([p.qhigh for p in parts]),
        source_format="+".join(sorted({p.source_format for p in parts})),
    )


def _stacked_scales(parts: list[PackedWeight]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The parts' scales and mins stacked. Where int4 parts with stored mins meet parts without (a
    fused layer of a Q4_1 and a Q4_0 part), all are stored (``-8 * scales`` for the latter; int5's
    ``-16 * scales``)."""
    if parts[0].super_scales:
        return torch.cat([p.scales for p in parts]), None
    scales = torch.cat([p.scales.float() for p in parts])  # fp16 converts exactly
    mins = None
    if any(p.mins is not None for p in parts):
        mins = torch.cat([int4_mins(p.scales, p.mins, p.qhigh is not None) for p in parts])
    # fp16 where every part had it and it holds every value (-8 d of a large fp16 d would not).
    half = all(p.scales.dtype == torch.float16 for p in parts) and (mins is None or _fits_half(mins))
    dtype = torch.float16 if half else torch.float32
    return scales.to(dtype), None if mins is None else mins.to(dtype)


def _fits_half(values: torch.Tensor) -> bool:
    return bool(torch.equal(values.half().float(), values))


# With fp32 activations (opt-in), from this many rows of x on (long prefill chunks), a packed
# weight is dequantized a chunk of rows at a time into one reused fp32 buffer and multiplied by oneDNN's GEMM,
# whose register blocking then beats the kernel's. Below it the kernel runs in one
# parallel region per layer where the GEMM path needs two per chunk, which costs
# dearly when the cores are shared. Measured on all the default model's layers, two
# threads on a loaded machine: the kernel is faster by 1.35x at 512 rows, 2.2x at 64;
# the GEMM path by 1.57x at 2048 rows.
GEMM_MIN_ROWS = 1024
_CHUNK_BYTES = 8 << 20  # of fp32 weight rows per GEMM chunk
ACTIVATIONS = ("int8", "int16", "fp32")


def activations_from_env() -> str:
    """``WEFT_QUANT_ACTIVATIONS`` (int8, int16 or fp32; default int8)."""
    value = (env.get("WEFT_QUANT_ACTIVATIONS") or "int8").strip().lower()
    if value not in ACTIVATIONS:
        raise ValueError(f"WEFT_QUANT_ACTIVATIONS must be one of {', '.join(ACTIVATIONS)}, got {value!r}.")
    return value


class _Kernel:
    """The compiled kernel, or the torch twin with the reason logged once when it cannot be built.

    ``isa`` (None: the kernel module's default) and ``activations`` pick the build and the
    decode path; ``choose_kernel`` sets them (the benchmarks compare one with another)."""

    def __init__(self) -> None:
        self._compiled: bool | None = None
        self._scratch = torch.empty(0)
        self._decode_op = None  # the integer-activation op, resolved once: a decode step makes 121 calls
        self.isa: str | None = None
        self.activations: str | None = None  # None: read from the environment on first use

    def compiled(self) -> bool:
        if self._compiled is None:
            from kernels import cpu_quant_linear

            if self.activations is None:
                self.activations = activations_from_env()
            self._decode_op = None
            try:
                ops = cpu_quant_linear.load(self.isa)
                self._compiled = True
            except cpu_quant_linear.KernelUnavailable as exc:
                logger.warning("Quantized linear layers use the slower torch twin: %s", exc)
                self._compiled = False
            else:
                op = {"int8": "quant_linear_i8", "int16": "quant_linear_i16"}.get(self.activations)
                self._decode_op = None if op is None else getattr(ops, op).default
        return self._compiled

    def linear(self, x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
        """``x [M, K]`` fp32 contiguous ``@ W^T`` -> ``[M, N]`` fp32."""
        if not self.compiled():
            return quant_linear_ref(x, w.qweight, w.scales, w.mins, w.group_size, w.qhigh)
        if self._decode_op is not None:
            # Integer activations at every row count (batch invariance: the module's notes). The op
            # straight, without the wrapper's look-ups: at one row they cost a tenth of the call.
            out = torch.empty(x.shape[0], w.qweight.shape[0])
            self._decode_op(x, w.qweight, w.scales, w.mins, w.group_size, out, w.qhigh)
            return out
        from kernels.cpu_quant_linear import dequantize_rows, quant_linear

        if w.scales.dtype == torch.float16:
            w = w.with_fp32_scales()  # the fp32 kernels read fp32 scales or the K formats' records
        if x.shape[0] < GEMM_MIN_ROWS:
            return quant_linear(x, w.qweight, w.scales, w.mins, w.group_size, isa=self.isa, qhigh=w.qhigh)
        n, k = w.shape
        chunk = max(1, min(n, _CHUNK_BYTES // (4 * k)))
        if self._scratch.numel() < chunk * k:
            self._scratch = torch.empty(chunk * k)
        outs = []
        for start in range(0, n, chunk):
            count = min(chunk, n - start)
            rows = self._scratch[: count * k].view(count, k)
            dequantize_rows(
                w.qweight,
                w.scales,
                w.mins,
                w.group_size,
                start,
                count,
                k,
                out=rows,
                isa=self.isa,
                qhigh=w.qhigh,
            )
            outs.append(x @ rows.T)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


_KERNEL = _Kernel()


def choose_kernel(isa: str | None, activations: str | None) -> None:
    """Run this process's quantized layers on build ``isa`` (None: the default) with
    ``activations`` (int8, int16 or fp32; None: ``WEFT_QUANT_ACTIVATIONS``, read at next use)."""
    if activations is not None and activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}.")
    _KERNEL.isa, _KERNEL.activations, _KERNEL._compiled = isa, activations, None


class QuantizedWeight:
    """A layer's weight as packed parts stacked by output rows (fused layers whose parts
    came in different formats keep one part per format run)."""

    def __init__(self, parts: list[PackedWeight]) -> None:
        self.parts = [p.contiguous() for p in _merge_runs(parts)]
        if any(p.in_features != self.parts[0].in_features for p in self.parts):
            raise ValueError("packed parts of one layer must share in_features.")

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].in_features)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def one_call(self) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
        """``run(x, out)``: ``x [M, K] @ W^T`` into ``out [M, N]`` (fp32, rows contiguous, row
        strides free) as the compiled integer-activation op straight, a call per part into its
        columns: the bits ``linear`` gives without a bias. None where ``linear`` runs another kernel
        (the fp32 activations, the torch twin). For callers that make many calls a step and check
        their tensors once (``services.worker.models.lean_decode``)."""
        if not _KERNEL.compiled() or _KERNEL._decode_op is None:
            return None
        op = _KERNEL._decode_op

        def part_call(p: PackedWeight) -> Callable[[torch.Tensor, torch.Tensor], None]:
            qweight, scales, mins, group_size, qhigh = p.qweight, p.scales, p.mins, p.group_size, p.qhigh
            return lambda x, out: op(x, qweight, scales, mins, group_size, out, qhigh)

        if len(self.parts) == 1:
            return part_call(self.parts[0])
        columns, start = [], 0
        for p in self.parts:
            columns.append((start, start + p.shape[0], part_call(p)))
            start += p.shape[0]

        def run(x: torch.Tensor, out: torch.Tensor) -> None:
            for first, stop, call in columns:
                call(x, out[:, first:stop])

        return run

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K] @ W^T (+ bias)`` in ``x``'s dtype, computed in fp32."""
        if (
            bias is None
            and len(self.parts) == 1
            and x.dim() == 2
            and x.dtype == torch.float32
            and x.is_contiguous()
        ):
            # A model's layers call with this (fp32 [T, K], one part, no bias): the kernel straight,
            # without the five no-op reshapes and casts below (about 5 us a call, 121 calls a step).
            return _KERNEL.linear(x, self.parts[0])
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        outs = [_KERNEL.linear(rows, p) for p in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if bias is not None:
            y += bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    def embed(self, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``token_ids`` of W, dequantized (embedding lookup); ``[T, K]`` in ``dtype``."""
        if len(self.parts) != 1:
            raise ValueError("a packed embedding has exactly one part.")
        p = self.parts[0]
        mins = None if p.mins is None else p.mins[token_ids]
        qhigh = None if p.qhigh is None else p.qhigh[token_ids]
        return dequantize_packed_ref(p.qweight[token_ids], p.scales[token_ids], mins, p.group_size, qhigh).to(
            dtype
        )

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


def _merge_runs(parts: list[PackedWeight]) -> list[PackedWeight]:
    """Adjacent parts of one layout merged, so a fused layer runs one kernel call per run."""
    runs: list[list[PackedWeight]] = []
    for part in parts:
        if runs and runs[-1][0].layout == part.layout:
            runs[-1].append(part)
        else:
            runs.append([part])
    return [run[0] if len(run) == 1 else cat_rows(run) for run in runs]


def finalize_quantized(model: nn.Module, dense_min_rows: int = 0, dense_int8: bool = False) -> None:
    """Turn every layer's loaded ``packed_parts`` into its ``quant`` and free its dense weight.

    A layer whose parts did not all come packed (a fused projection with one
    part in a format without a packed layout) is dequantized into its dense
    weight instead. A tied LM head shares its embedding's packed weight.
    With ``dense_min_rows`` > 0 each linear layer also keeps the dequantized
    weight, in its own dtype, as its dense copy for steps of that many rows on
    (``services/config/dense_copy.py``); embeddings look rows up in the packed one.
    ``dense_int8`` adds an int8 copy beside it (``services.worker.layers.int8_linear``), except
    where its GEMM would be ``torch._int_mm``'s scalar loop (``int8_copy_runs_here``): then the model
    dtype's copy alone, from ``DEFAULT_DENSE_MIN_ROWS`` rows at least, with a warning.
    """
    if dense_int8 and not int8_copy_runs_here():
        # The config chose the copy from the CPU's flags; the kernel it counted on is missing here.
        dense_min_rows = max(dense_min_rows, DEFAULT_DENSE_MIN_ROWS)
        logger.warning(
            "No int8 dense copy: its GEMM would be torch._int_mm's scalar loop on this CPU (weft's AVX2 "
            "int8 kernel was not built, or WEFT_AVX2_INT8=0). The model dtype's copy runs steps of %d "
            "rows and more instead.",
            dense_min_rows,
        )
        dense_int8 = False
    quantized_by_param: dict[int, QuantizedWeight] = {}
    for name, module in model.named_modules():
        parts: dict[int, PackedWeight] = getattr(module, "packed_parts", None) or {}
        if not parts:
            continue
        del module.packed_parts
        expected = len(getattr(module, "output_sizes", [None]))
        if len(parts) < expected:
            _dequantize_into(module, parts, name)
            continue
        module.quant = QuantizedWeight([parts[i] for i in sorted(parts)])
        if module.quant.shape != tuple(module.weight.shape):
            raise ValueError(
                f"Checkpoint weights of shape {module.quant.shape} do not fit {name} "
                f"{tuple(module.weight.shape)}."
            )
        quantized_by_param[id(module.weight)] = module.quant
    for module in model.modules():
        shared = getattr(module, "weight_is_shared", False) and module.weight is not None
        if shared and id(module.weight) in quantized_by_param:
            module.quant = quantized_by_param[id(module.weight)]
    for module in model.modules():
        if getattr(module, "quant", None) is None:
            continue
        if dense_min_rows and hasattr(module, "dense_min_rows"):  # a linear layer
            module.dense_min_rows = dense_min_rows
            dense = module.quant.dequantize()
            if dense_int8:
                module.int8 = Int8Weight(dense)
            module.weight = nn.Parameter(dense.to(module.weight.dtype), requires_grad=False)
        else:
            module.weight = None


def _dequantize_into(module: nn.Module, parts: dict[int, PackedWeight], name: str) -> None:
    logger.info("%s: some parts have no packed layout; the layer runs dequantized.", name)
    sizes = module.output_sizes
    for i, part in parts.items():
        module.weight.data.narrow(0, sum(sizes[:i]), sizes[i]).copy_(part.dequantize())


@dataclass(frozen=True)
class QuantizedReport:
    """What the packed weights of a model hold: parameters and bytes, per GGUF format."""

    params: dict[str, int]
    nbytes: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes.values())

    @property
    def total_params(self) -> int:
        return sum(self.params.values())

    def describe(self) -> str:
        per_format = ", ".join(
            f"{fmt} {self.params[fmt] / 1e6:.1f}M params at {self.nbytes[fmt] / self.params[fmt]:.3f} B/param"
            for fmt in sorted(self.params)
        )
        return (
            f"{self.total_bytes / 2**20:.1f} MiB packed for {self.total_params / 1e6:.1f}M parameters "
            f"({self.total_bytes / max(1, self.total_params):.3f} B/param; {per_format})"
        )


def quantized_report(model: nn.Module) -> QuantizedReport:
    """Each packed weight counted once (a tied head shares its embedding's)."""
    seen: set[int] = set()
    params: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    for module in model.modules():
        quant = getattr(module, "quant", None)
        if quant is None or id(quant) in seen:
            continue
        seen.add(id(quant))
        for part in quant.parts:
            n, k = part.shape
            params[part.source_format] = params.get(part.source_format, 0) + n * k
            nbytes[part.source_format] = nbytes.get(part.source_format, 0) + part.nbytes
    return QuantizedReport(params, nbytes)
