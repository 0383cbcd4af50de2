"""What this CPU can do, and which of weft's CPU paths pay on it: the one place that reads its flags.

``cpu_flags()`` reads the flags line of ``/proc/cpuinfo``; the feature sets below name what each
of weft's C++ kernel builds needs (``kernels/cpu_build.py`` pairs each with its compiler flags);
the predicates turn flags into the measured choices that engine configuration
(``services/config/engine_args.py``) and the worker make. Every predicate takes the flags as data
(``/proc/cpuinfo``'s when None), so a choice can be checked for any CPU. Torch-free and stdlib
only: the API process resolves configs with it.
"""

from __future__ import annotations

from pathlib import Path

# AVX2 + FMA (+ F16C), the default build target where the CPU has them.
AVX2_FLAGS = ("avx2", "fma", "f16c")
# AVX-512 with VNNI for the kernels that use integer dot products (vpdpbusd on 256-bit vectors
# needs AVX512VL); the AVX2 flags come along for the code they share.
AVX512_VNNI_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", *AVX2_FLAGS)
# AVX-512 (F, VL, BW) for kernels whose loops want its 32 vector registers even on 256-bit vectors.
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", *AVX2_FLAGS)
# AVX512 plus AVX512_BF16 (vdpbf16ps: bf16 pair dot products into fp32).
AVX512_BF16_FLAGS = (*AVX512_FLAGS, "avx512_bf16")
# AVX512_BF16 plus AMX tiles with bf16 products (tdpbf16ps).
AMX_BF16_FLAGS = (*AVX512_BF16_FLAGS, "amx_tile", "amx_bf16")
# AVX512 plus AMX tiles with int8 products (tdpbssd).
AMX_INT8_FLAGS = (*AVX512_FLAGS, "amx_tile", "amx_int8")


def cpu_flags() -> set[str]:
    """The flags line of ``/proc/cpuinfo`` (empty where it cannot be read). Only whole flags of that
    line count: a flag's name inside the model name, or inside a longer flag, is not the flag."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def has_all(needed: tuple[str, ...], flags: set[str] | None = None) -> bool:
    """Whether the CPU has every one of ``needed``."""
    flags = cpu_flags() if flags is None else flags
    return set(needed) <= flags


def cpu_has_fast_bf16(flags: set[str] | None = None) -> bool:
    """bf16 math in hardware makes bf16 faster than fp32: AMX tiles (``amx_bf16``), or AVX-512's
    bf16 dot products (``avx512_bf16``), where weft ran the default model dequantized 1.3-2x
    faster in bf16 (README). With AVX2 only, bf16 is converted in software: fp32 is faster."""
    flags = cpu_flags() if flags is None else flags
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cpu_has_wide_int8_dot(flags: set[str] | None = None) -> bool:
    """AMX int8 tiles or AVX-512 VNNI: int8 GEMMs fast enough that a 2,048-token step and a one-row
    packed decode both stay short (``services/config/engine_args.py``'s step budget and the dense
    copy's first rows follow it). With AVX2 alone, weft's int8 GEMM runs about 110 G multiply-adds/s
    on two cores."""
    flags = cpu_flags() if flags is None else flags
    return "amx_int8" in flags or "avx512_vnni" in flags


def cpu_int8_copy_pays(flags: set[str] | None = None) -> bool:
    """The int8 dense copy was measured faster than the bf16 one from 32 rows on (README, "int8
    dense copy") on AVX-512 VNNI with bf16 dot products and no AMX, and on weft's own VNNI GEMM
    from 2 rows on. With AMX tiles oneDNN's bf16 GEMM beat the int8 copy on oneDNN's int8 matmul
    (level at best over a forward), but weft's own GEMM on AMX int8 tiles beats both up to 128
    rows."""
    flags = cpu_flags() if flags is None else flags
    if has_all(AMX_INT8_FLAGS, flags):
        return True
    return {"avx512_vnni", "avx512_bf16"} <= flags and not flags & {"amx_int8", "amx_bf16", "amx_tile"}


def cpu_own_int8_gemm(flags: set[str] | None = None) -> bool:
    """Whether the int8 copy's GEMMs run on one of weft's kernels here, by the flags they are built
    for: AMX int8 tiles (``kernels.cpu_amx_int8``), or else AVX-512 VNNI (``kernels.cpu_vnni_int8``),
    or else AVX2 (``kernels.cpu_avx2_int8``); then auto's copies start at
    ``OWN_INT8_GEMM_DENSE_MIN_ROWS``, and a float32 that dtype auto picked keeps an int8 copy too
    (on AVX2 alone weft's GEMM ran the default model's matmuls 1.5-2.7x the fp32 GEMM from 2 rows
    a step). (The worker falls back to torch's GEMMs where it cannot build them, and the model
    dtype's copy takes the steps those lose.)"""
    flags = cpu_flags() if flags is None else flags
    if "amx_int8" in flags:
        return has_all(AMX_INT8_FLAGS, flags)
    if "avx512_vnni" in flags:
        return has_all(AVX512_VNNI_FLAGS, flags)
    return has_all(AVX2_FLAGS, flags)
