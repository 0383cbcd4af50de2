"""The compiled CPU element-wise kernels (``csrc/cpu_fused.cpp``): RMSNorm fused
with the residual add (before it, Llama's; after it, and the next norm, Gemma 3's), plain RMSNorm,
SiLU-and-mul, GeLU(tanh)-and-mul, neox rotary (alone, or after QK-norm), fp32 and bf16;
a row's argmax (greedy sampling's); the two passes around an int8 GEMM (rows rounded to int8,
the int32 result scaled back); and, in ``csrc/gguf_repack.cpp``, the load-time repack's byte moves:
Q4_K's and Q5_K's super-blocks into weft's records and nibbles, and a field cut out
of every block (twins: ``services.worker.gguf_repack.k_records_and_nibbles_ref``
and ``quants_ref``).

Built like the decode-attention kernel (``kernels.cpu_attention``): by
``python -m kernels.cpu_fused`` ahead of time, else on first use, cached by
``torch.utils.cpp_extension``. ``available()`` says once per process
whether the CPU layers may use them: false, with a logged reason, when the
build cannot happen, or when ``WEFT_CPU_FUSED=0`` turns them off (to
measure what they gain).

The torch twins are in ``kernels.reference`` (``fused_add_rms_norm_ref``,
``rms_norm_ref``, ``norm_add_norm_ref``, ``qk_norm_rotary_ref``, ``silu_and_mul_ref``,
``gelu_tanh_and_mul_ref``, ``rotary_embedding_ref``, ``argmax_rows_ref``,
``quantize_rows_int8_ref``, ``scale_int32_ref``, ``scale_silu_quantize_int8_ref``); each
wrapper here refuses bad arguments with a ValueError, most with their twin's messages. The norm and
SiLU wrappers run those Python checks only once the kernel has refused the
arguments (its checks guard every byte it touches): at one decode row the
Python checks cost about as much as the kernel itself, 91 times a step.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from kernels.cpu_build import KernelUnavailable, build, wide_isa
from kernels.reference import (
    check_fused_add_rms_norm_args,
    check_quantize_rows_int8_args,
    check_rotary_args,
    check_scale_int32_args,
    check_scale_silu_quantize_int8_args,
    check_silu_and_mul_args,
)
from services import env

# The element-wise kernels, and the load-time repack's byte moves (one library).
SOURCES = (
    Path(__file__).parent / "csrc" / "cpu_fused.cpp",
    Path(__file__).parent / "csrc" / "gguf_repack.cpp",
)
DTYPES = (torch.float32, torch.bfloat16)
ENV_SWITCH = "WEFT_CPU_FUSED"  # "0" turns the fused CPU path off; read only by enabled_by_env()

logger = logging.getLogger(__name__)


def enabled_by_env() -> bool:
    value = env.get_raw(ENV_SWITCH, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{ENV_SWITCH} must be 0 or 1, got {value!r}.")
    return value in ("1", "true", "on")


@functools.cache
def available() -> bool:
    """Whether the CPU layers use these kernels; builds them on the first call."""
    if not enabled_by_env():
        logger.info(
            "fused CPU kernels off (%s=0): RMSNorm, SiLU-and-mul and rotary run as torch ops.", ENV_SWITCH
        )
        return False
    try:
        load()
    except KernelUnavailable as exc:
        logger.warning("%s; RMSNorm, SiLU-and-mul and rotary fall back to torch ops.", exc)
        return False
    return True


@functools.cache
def load() -> None:
    """Build (or load the cached build of) the kernels and register ``torch.ops.weft_fused``.

    For ``wide_isa()``: the element-wise loops vectorize 16 floats wide with AVX-512, and run
    compute-bound at prefill sizes (1,831 x 3,072 bf16, one thread: SiLU-and-mul 4.48 -> 3.03 ms,
    scale_int32 1.63 -> 1.17 ms against the AVX2 build, results bit-identical)."""
    build("weft_cpu_fused", SOURCES, "the fused CPU kernels", isa=wide_isa())


def _checked_call(op, *args) -> None:
    """``op(*args)`` after ``load()``, the kernel's refusal (its checks guard every byte it touches)
    raised as a ValueError with its first line."""
    load()
    try:
        op(*args)
    except RuntimeError as exc:
        raise ValueError(str(exc).splitlines()[0]) from exc


def _refused(check, error: Exception) -> None:
    """The kernel refused its arguments: raise ``check``'s clear ValueError, else the kernel's error."""
    check()
    raise error


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual = x + residual``, then ``x = norm(residual) * weight`` (``[T, N]`` each)."""
    load()
    try:
        torch.ops.weft_fused.fused_add_rms_norm(x, residual, weight, float(eps))
    except (RuntimeError, IndexError) as exc:
        _refused(lambda: check_fused_add_rms_norm_args(x, weight, residual, cpu=True), exc)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [T, N]`` -> a new ``norm(x) * weight``."""
    load()
    try:
        out = torch.empty(x.shape, dtype=x.dtype)
        torch.ops.weft_fused.rms_norm(out, x, weight, float(eps))
    except (RuntimeError, IndexError) as exc:
        _refused(lambda: check_fused_add_rms_norm_args(x, weight, None, cpu=True), exc)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [T, 2I]`` (gate columns first) -> a new ``silu(gate) * up`` ``[T, I]``."""
    load()
    try:
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
        torch.ops.weft_fused.silu_and_mul(out, x)
    except (RuntimeError, IndexError) as exc:
        _refused(lambda: check_silu_and_mul_args(x, cpu=True), exc)
    return out


def norm_add_norm(
    out: torch.Tensor,
    residual: torch.Tensor,
    x: torch.Tensor,
    w_post: torch.Tensor,
    w_pre: torch.Tensor,
    eps: float,
) -> None:
    """A post-norm sublayer's end and the next pre-norm (Gemma 3's layer), in place, ``[T, N]`` each:
    ``residual += norm(x) * w_post``, then ``out = norm(residual) * w_pre``; the bits of
    ``rms_norm``, ``add_`` and ``rms_norm`` (twin: ``kernels.reference.norm_add_norm_ref``). The
    kernel refuses bad arguments (and overlapping tensors) with a ValueError."""
    _checked_call(torch.ops.weft_fused.norm_add_norm, out, residual, x, w_post, w_pre, float(eps))


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [T, 2I]`` (gate columns first) -> a new ``gelu_tanh(gate) * up`` ``[T, I]`` (Gemma's GeGLU,
    the GeLU's tanh form as ``gate / (1 + exp(-2y))``, ``y`` its tanh's argument)."""
    load()
    try:
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
        torch.ops.weft_fused.gelu_tanh_and_mul(out, x)
    except (RuntimeError, IndexError) as exc:
        _refused(lambda: check_silu_and_mul_args(x, cpu=True), exc)
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row of ``x [rows, n]`` (float32, contiguous in its rows) -> the index of its maximum,
    int64 ``[rows]``: the first on ties, the first NaN where a row holds one, as torch's
    ``max(dim=-1).indices`` (``kernels.reference.argmax_rows_ref``). The kernel refuses other
    arguments with a ValueError."""
    load()
    out = torch.empty(x.shape[0] if x.dim() else 0, dtype=torch.int64)
    torch.ops.weft_fused.argmax_rows(out, x)
    return out


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    *,
    check: bool = True,
) -> None:
    """Rotate ``query [T, H * D]`` and ``key [T, KVH * D]`` in place, neox style, in one pass.

    ``check=False`` skips the Python checks (clear messages) for a caller that
    built the arguments itself; the kernel still checks what guards memory.
    """
    if check:
        check_rotary_args(positions, query, key, cos, sin, head_dim, cpu=True)
    load()
    torch.ops.weft_fused.rotary_neox(positions.long(), query, key, cos, sin, head_dim)


def qk_norm_rotary(
    positions: torch.Tensor,
    query_out: torch.Tensor,
    key_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
) -> None:
    """QK-norm and the rotation in one pass: each head's row of ``query [T, H * D]`` and ``key
    [T, KVH * D]`` normalized (``rms_norm`` by ``q_weight`` / ``k_weight``, ``[D]``) into
    ``query_out`` and ``key_out``, which are then rotated in place (``rotary_embedding``); the bits of
    those calls (twin: ``kernels.reference.qk_norm_rotary_ref``). An output is its input, or memory
    apart from the other tensors. The kernel refuses bad arguments with a ValueError."""
    _checked_call(
        torch.ops.weft_fused.qk_norm_rotary,
        *(positions, query_out, key_out, query, key, q_weight, k_weight, float(eps), cos, sin, head_dim),
    )


def quantize_rows_int8(x: torch.Tensor, hadamard_block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` -> (``q [T, K]`` int8, ``scale [T]`` fp32): each row rounded to ``scale * q``,
    after the Walsh-Hadamard rotation of ``kernels.reference.hadamard_rows_ref`` where
    ``hadamard_block`` (4, 16 or 64) is not 0."""
    load()
    try:
        q = torch.empty(x.shape, dtype=torch.int8)
        scale = torch.empty(x.shape[0], dtype=torch.float32)
        torch.ops.weft_fused.quantize_rows_int8(q, scale, x, hadamard_block)
    except (RuntimeError, IndexError) as exc:
        _refused(lambda: check_quantize_rows_int8_args(x, hadamard_block), exc)
    return q, scale


def scale_int32(
    acc: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``acc [T, N]`` (an integer GEMM's int32, or float32 holding the integers) -> a new
    ``acc * row_scale[:, None] * col_scale (+ bias)`` in ``dtype``."""
    load()
    try:
        out = torch.empty(acc.shape, dtype=dtype)
        torch.ops.weft_fused.scale_int32(out, acc, row_scale, col_scale, bias)
    except (RuntimeError, IndexError) as exc:
        _refused(lambda: check_scale_int32_args(acc, row_scale, col_scale, bias, dtype), exc)
    return out


def scale_silu_quantize_int8(
    acc: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    hadamard_block: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP between its int8 GEMMs in one pass: ``acc [T, 2I]`` (the gate/up product) ->
    (``q [T, I]`` int8, ``scale [T]`` fp32) of ``silu(gate) * up``, each of gate, up and the
    product rounded to ``dtype`` as ``scale_int32``, ``silu_and_mul`` and ``quantize_rows_int8``
    one after the other round them (bit for bit)."""
    load()
    try:
        q = torch.empty(acc.shape[0], acc.shape[1] // 2, dtype=torch.int8)
        scale = torch.empty(acc.shape[0], dtype=torch.float32)
        torch.ops.weft_fused.scale_silu_quantize_int8(
            q, scale, acc, row_scale, col_scale, hadamard_block, dtype
        )
    except (RuntimeError, IndexError) as exc:
        _refused(
            lambda: check_scale_silu_quantize_int8_args(acc, row_scale, col_scale, hadamard_block, dtype), exc
        )
    return q, scale


def k_records_and_nibbles(
    records: torch.Tensor, nibbles: torch.Tensor, blocks: torch.Tensor, qs_start: int
) -> None:
    """Q4_K's or Q5_K's super-blocks ``blocks [N, B, bytes]`` uint8 into ``records [N, B, 20]`` and
    ``nibbles`` (``N * B * 128`` bytes) in weft's layout (``services.worker.gguf_repack``)."""
    load()
    torch.ops.weft_fused.k_records_and_nibbles(records, nibbles, blocks, qs_start)


def block_bytes(out: torch.Tensor, blocks: torch.Tensor, start: int, stop: int) -> None:
    """Bytes ``[start, stop)`` of each block of ``blocks [N, B, bytes]`` uint8 into ``out``
    (``N * B * (stop - start)`` bytes)."""
    load()
    torch.ops.weft_fused.block_bytes(out, blocks, start, stop)


if __name__ == "__main__":  # build ahead of first use (the Docker image does)
    load()
    print(f"built and loaded the fused CPU kernels ({wide_isa()[0]})")
