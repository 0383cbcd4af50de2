"""The compiled CPU kernels for weights kept packed (``csrc/cpu_quant_linear.cpp``).

Built like the CPU attention kernel (``kernels.cpu_attention``): with the
machine's compiler through ``torch.utils.cpp_extension`` by ``make install``
(``python -m kernels.cpu_quant_linear``), else on first use. One build per
instruction set, each named after it and registering its ops under its own
namespace (``torch.ops.weft_quant_<isa>``): ``avx512vnni`` (AVX-512 with
VNNI), ``avx2`` (AVX2 + FMA) and ``generic``. ``load()`` takes the best the
CPU runs, or the one ``WEFT_QUANT_ISA`` names (to measure one against
another); ``load(isa)`` a given one. It raises ``KernelUnavailable`` with the
reason when the build cannot happen; callers then use the torch twins in
``kernels.reference`` (``quant_linear_ref``, ``dequantize_packed_ref``).

Layouts int8, int4, int5 (int4 plus a ``qhigh`` plane of fifth bits, passed
last and optional to every op; beside Q5_K's records as bit planes per
super-block, ``kernels.reference.packed_values``) and int6 (Q6_K's: int4's bytes in groups of 16
plus two high bits a weight in ``qhigh``). Three matmuls: ``quant_linear`` (fp32 activations; sums in another order
than the twin's), ``quant_linear_i16`` and ``quant_linear_i8`` (activations
rounded to int16 or int8 per weight group, integer dot products; twin
``quant_linear_i8_ref``; ``quant_linear_i8`` against Q4_K, Q5_K and Q6_K records
rounds x per super-block of 256 instead and sums a super-block's groups in
integers, as llama.cpp's Q4_K and Q6_K x Q8_K dots). Layouts and
numerics are described in the C++ source.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kernels.cpu_build import AVX512_VNNI, AVX512_VNNI_FLAGS, KernelUnavailable, build, cpu_flags
from services import env

SOURCE = Path(__file__).parent / "csrc" / "cpu_quant_linear.cpp"
ENV_ISA = "WEFT_QUANT_ISA"  # forces one build (avx512vnni, avx2 or generic); read only by default_isa()

# Fastest first: (name, compiler flags), and the CPU flags each needs.
ISAS: dict[str, tuple[tuple[str, list[str]], tuple[str, ...]]] = {
    "avx512vnni": (AVX512_VNNI, AVX512_VNNI_FLAGS),
    "avx2": (("avx2", ["-mavx2", "-mfma", "-mf16c"]), ("avx2", "fma", "f16c")),
    "generic": (("generic", []), ()),
}

__all__ = [
    "KernelUnavailable",
    "default_isa",
    "dequantize_rows",
    "load",
    "quant_linear",
    "quant_linear_i16",
    "quant_linear_i8",
    "set_single_row_blocks",
    "supported_isas",
]


def supported_isas() -> list[str]:
    """The builds this CPU can run, fastest first."""
    flags = cpu_flags()
    return [name for name, (_, needs) in ISAS.items() if all(f in flags for f in needs)]


def default_isa() -> str:
    """``WEFT_QUANT_ISA`` when set, else the fastest supported build. An unknown name is a
    ValueError; one the CPU cannot run, ``KernelUnavailable``."""
    forced = env.get_raw(ENV_ISA, "").strip().lower()
    supported = supported_isas()
    if not forced:
        return supported[0]
    if forced not in ISAS:
        raise ValueError(f"{ENV_ISA}={forced!r} is not one of {', '.join(ISAS)}.")
    if forced not in supported:
        raise KernelUnavailable(f"{ENV_ISA}={forced}: this CPU lacks {', '.join(ISAS[forced][1])}.")
    return forced


@functools.cache
def load(isa: str | None = None):
    """Build (or load the cached build of) the kernels for ``isa`` and return their op
    namespace, ``torch.ops.weft_quant_<isa>``. Without ``isa``: the one ``WEFT_QUANT_ISA``
    names, else the fastest supported build that builds here (an older compiler may lack
    the AVX-512 flags; the next build is then tried, and every reason is in the error)."""
    if isa is not None:
        return _load_build(isa)
    candidates = [default_isa()] if env.get_raw(ENV_ISA, "").strip() else supported_isas()
    reasons = []
    for name in candidates:
        try:
            return _load_build(name)
        except KernelUnavailable as exc:
            reasons.append(str(exc))
    raise KernelUnavailable("; ".join(reasons))


def _load_build(isa: str):
    if isa not in supported_isas():
        raise KernelUnavailable(f"this CPU cannot run the {isa} build of the quantized-linear kernel.")
    target, _ = ISAS[isa]
    namespace = f"weft_quant_{isa}"
    build(
        "weft_cpu_quant_linear",
        SOURCE,
        f"the CPU quantized-linear kernel ({isa})",
        isa=target,
        defines=(f"QUANT_LIBRARY_NS={namespace}",),
    )
    return getattr(torch.ops, namespace)


def _output(x: torch.Tensor, qweight: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return torch.empty(x.shape[0], qweight.shape[0], dtype=torch.float32) if out is None else out


# The ops by activation setting: fp32, or each row of x rounded per group of ``group_size``
# (int8 against Q4_K, Q5_K and Q6_K records: per 256) to int8 or int16 first (then integer dot products).
_OPS = {"fp32": "quant_linear", "int8": "quant_linear_i8", "int16": "quant_linear_i16"}


def quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    out: torch.Tensor | None = None,
    isa: str | None = None,
    activations: str = "fp32",
    qhigh: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [M, K]`` fp32 ``@ W^T`` -> ``[M, N]`` fp32, W packed (int4 where ``qweight`` is ``[N, K / 2]``,
    its ``mins`` None for Q4_0's ``-8 * scales``; int5 where ``qhigh [N, K / 8]`` comes with it, its
    ``mins`` None for Q5_0's ``-16 * scales``, its bits per-group words, or bit planes with records; int6 where ``group_size`` is 16 and ``qhigh [N, K / 4]``
    comes with it, ``mins`` None; else int8, ``mins`` None)."""
    out = _output(x, qweight, out)
    getattr(load(isa), _OPS[activations])(x, qweight, scales, mins, group_size, out, qhigh)
    return out


quant_linear_i8 = functools.partial(quant_linear, activations="int8")
quant_linear_i16 = functools.partial(quant_linear, activations="int16")


def set_single_row_blocks(on: bool, isa: str | None = None) -> None:
    """Whether ``quant_linear_i8`` and ``quant_linear_i16`` take four weight rows at a time (the
    default) or row by row (the loop batch-1 steps ran before): the same bits either way;
    process-wide, so a benchmark can compare the two."""
    load(isa).set_single_row_blocks(on)


def dequantize_rows(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    start: int,
    count: int,
    in_features: int,
    out: torch.Tensor | None = None,
    isa: str | None = None,
    qhigh: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``[start, start + count)`` of the packed W as fp32 ``[count, in_features]``."""
    if out is None:
        out = torch.empty(count, in_features, dtype=torch.float32)
    load(isa).dequantize_rows(qweight, scales, mins, group_size, start, out, qhigh)
    return out


def _build_all() -> int:
    """Every build the CPU runs (make install, the Docker image); fails only if none builds."""
    built = 0
    for name in supported_isas():
        try:
            print(f"built and loaded the CPU quantized-linear kernel ({load(name).isa()})")
            built += 1
        except KernelUnavailable as exc:
            print(f"not built: {exc}")
    return 0 if built else 1


if __name__ == "__main__":
    raise SystemExit(_build_all())
