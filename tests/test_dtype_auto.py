"""``dtype="auto"`` on CPU: bf16 where the CPU does bf16 math in hardware, fp32 elsewhere.

The flags are fed in (or a cpuinfo file is), never read from the machine the tests run on.
"""

from __future__ import annotations

import pytest

from kernels import cpu_caps
from services.config import engine_args

AVX2_ONLY = {"sse4_2", "avx", "avx2", "fma", "f16c"}
AVX512_NO_BF16 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"}
AVX512_BF16 = AVX512_NO_BF16 | {"avx512_bf16", "avx512_vbmi"}  # Zen 4, Cooper Lake
AMX = AVX512_BF16 | {"amx_bf16", "amx_tile", "amx_int8"}  # Sapphire Rapids


@pytest.mark.parametrize(
    "flags, fast, int8_pays",
    [
        (AVX2_ONLY, False, False),
        (AVX512_NO_BF16, False, False),
        (AVX512_BF16, True, True),
        (AMX, True, True),
        (set(), False, False),
    ],
    ids=["avx2", "avx512-no-bf16", "avx512-bf16", "amx", "none"],
)
def test_fast_bf16_and_the_int8_copy_per_flag_set(flags, fast, int8_pays):
    """The int8 copy pays beside a bf16 copy where it was measured: AVX-512 VNNI with bf16 dot
    products, or AMX int8 tiles; weft's own GEMMs run it (from 2 rows a step) on AMX, on AVX-512
    VNNI and on AVX2 alone."""
    assert cpu_caps.cpu_has_fast_bf16(flags) is fast
    assert cpu_caps.cpu_int8_copy_pays(flags) is int8_pays
    assert cpu_caps.cpu_own_int8_gemm(flags) is (flags != set())


@pytest.mark.parametrize(
    "flags, rows",
    [(AVX2_ONLY, 1), (AVX512_NO_BF16, 2), (AVX512_BF16, 2), (AMX, 2)],
    ids=["avx2", "vnni", "bf16", "amx"],
)
def test_where_wefts_own_int8_gemm_runs_auto_copies_start_at(flags, rows):
    """Every step on AVX2 alone (the one-call int8 layers and the lean decode path beat the packed
    kernels at one row there); from 2 rows on AVX-512 VNNI and AMX."""
    assert engine_args.own_int8_gemm_first_rows(flags) == rows


@pytest.mark.parametrize("fast, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_follows_the_flags_on_cpu(monkeypatch, fast, expected):
    monkeypatch.setattr(engine_args, "cpu_has_fast_bf16", lambda flags=None: fast)
    assert engine_args.resolve_dtype("auto", "cpu") == expected
    assert engine_args.resolve_dtype("float32", "cpu") == "float32"  # an explicit dtype always wins
    assert engine_args.resolve_dtype("bf16", "cpu") == "bfloat16"


def test_weights_kept_quantized_follow_their_dense_copy_on_cpu(monkeypatch):
    """With a dense copy, batched steps run dense GEMMs, which bf16 makes faster; without one the
    packed kernel computes in fp32 either way, so bf16 activations would only add conversions."""
    monkeypatch.setattr(engine_args, "cpu_has_fast_bf16", lambda flags=None: True)
    assert engine_args.resolve_dtype("auto", "cpu", "gguf") == "float32"
    assert engine_args.resolve_dtype("auto", "cpu", "gguf", dense_copy=True) == "bfloat16"
    assert engine_args.resolve_dtype("auto", "cpu", "none") == "bfloat16"
    assert engine_args.resolve_dtype("bfloat16", "cpu", "gguf") == "bfloat16"
    monkeypatch.setattr(engine_args, "cpu_has_fast_bf16", lambda flags=None: False)
    assert engine_args.resolve_dtype("auto", "cpu", "gguf", dense_copy=True) == "float32"


def test_auto_is_bf16_on_cuda(monkeypatch):
    monkeypatch.setattr(engine_args, "cpu_has_fast_bf16", lambda flags=None: False)
    assert engine_args.resolve_dtype("auto", "cuda") == "bfloat16"


def _cpuinfo(tmp_path, monkeypatch, text: str) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    monkeypatch.setattr(cpu_caps, "Path", lambda _: path)


def test_flags_come_from_the_flags_line_of_cpuinfo(tmp_path, monkeypatch):
    _cpuinfo(
        tmp_path,
        monkeypatch,
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\nbugs\t\t: sysret_ss_attrs\n",
    )
    assert cpu_caps.cpu_has_fast_bf16()


def test_a_name_outside_the_flags_line_does_not_count(tmp_path, monkeypatch):
    """Only whole flags count: ``avx512_bf16`` in another line (or inside a longer word) is not the flag."""
    _cpuinfo(
        tmp_path, monkeypatch, "model name\t: has avx512_bf16 in its name\nflags\t\t: fpu avx2 xavx512_bf16\n"
    )
    assert not cpu_caps.cpu_has_fast_bf16()


def test_no_cpuinfo_means_fp32(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_caps, "Path", lambda _: tmp_path / "missing")
    assert not cpu_caps.cpu_has_fast_bf16()


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of"):
        engine_args.resolve_dtype("float8", "cpu")
