"""The compiled fused CPU kernels (RMSNorm + residual, RMSNorm, SiLU-and-mul, rotary) against their torch twins."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from kernels import cpu_fused
from kernels.reference import (
    argmax_rows_ref,
    fused_add_rms_norm_ref,
    gelu_tanh_and_mul_ref,
    norm_add_norm_ref,
    qk_norm_rotary_ref,
    rms_norm_ref,
    rotary_embedding_ref,
    silu_and_mul_ref,
)
from services.worker.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the CPU kernels with"
)

DTYPES = (torch.float32, torch.bfloat16)
# Rows: one decode token, a batch that splits over threads, a ragged prefill.
ROWS = (1, 64, 301)


def rows_view(
    gen, rows: int, cols: int, dtype: torch.dtype, strided: bool, scale: float = 1.0
) -> torch.Tensor:
    """[rows, cols]; strided: a column slice of a wider tensor, as q is of the fused qkv."""
    width = cols + 40 if strided else cols
    wide = (torch.randn(rows, width, generator=gen) * scale).to(dtype)
    return wide[:, 8 : 8 + cols] if strided else wide


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("hidden", [576, 77])  # SmolLM2's width, and one no vector width divides
def test_fused_add_rms_norm_matches_twin(generator, close, dtype, rows, strided, hidden):
    x = rows_view(generator, rows, hidden, dtype, strided, scale=3.0)
    residual = rows_view(generator, rows, hidden, dtype, strided)
    weight = (torch.rand(hidden, generator=generator) + 0.5).to(dtype)
    x_ref, residual_ref = x.clone(), residual.clone()
    fused_add_rms_norm_ref(x_ref, residual_ref, weight, 1e-5)
    cpu_fused.fused_add_rms_norm(x, residual, weight, 1e-5)
    # The new residual is one rounded add: exact. The normed row may differ by a rounding step.
    assert torch.equal(residual, residual_ref)
    close(x, x_ref, dtype, scale=4.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_matches_twin_and_leaves_input(generator, close, dtype, rows, strided):
    x = rows_view(generator, rows, 576, dtype, strided, scale=2.0)
    before = x.clone()
    weight = (torch.rand(576, generator=generator) + 0.5).to(dtype)
    out = cpu_fused.rms_norm(x, weight, 1e-6)
    assert torch.equal(x, before)
    close(out, rms_norm_ref(x, weight, 1e-6), dtype, scale=4.0)


def test_fused_add_rms_norm_fp32_matches_torch_closely(generator):
    """fp32 is the parity dtype: only the order of one sum differs from torch's."""
    x, residual = torch.randn(64, 576, generator=generator), torch.randn(64, 576, generator=generator)
    weight = torch.rand(576, generator=generator) + 0.5
    x_ref, residual_ref = x.clone(), residual.clone()
    fused_add_rms_norm_ref(x_ref, residual_ref, weight, 1e-5)
    cpu_fused.fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(x, x_ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape", [(1, 640), (7, 640), (5, 4, 256)], ids=["decode", "prefill", "per-head"])
def test_gemmas_norm_runs_the_compiled_norm_by_one_plus_its_weight(generator, shape):
    """An fp32 GemmaRMSNorm on CPU (Gemma 3's six a layer, per head for QK-norm) is the compiled
    RMSNorm with ``1 + weight``: its torch path's numbers up to the order of one sum, whatever the
    input's strides, and made again when the weight is written."""
    from services.worker.layers.norm import GemmaRMSNorm

    norm = GemmaRMSNorm(shape[-1], 1e-6)
    assert norm._cpu_fused
    norm.weight.copy_(torch.randn(shape[-1], generator=generator) * 0.5)
    x = torch.randn(*shape[:-1], shape[-1] + 24, generator=generator)[..., 8 : 8 + shape[-1]]  # strided
    norm._cpu_fused = False
    expected = norm(x)
    norm._cpu_fused = True
    torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=1e-6)
    norm.weight.copy_(torch.randn(shape[-1], generator=generator))  # a reload: 1 + weight made again
    norm._cpu_fused = False
    expected = norm(x)
    norm._cpu_fused = True
    torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("inner", [1536, 45])
def test_silu_and_mul_matches_twin(generator, close, dtype, rows, strided, inner):
    x = rows_view(generator, rows, 2 * inner, dtype, strided, scale=4.0)  # large |gate| exercises both tails
    x[0, 0], x[0, 1] = -200.0, 200.0  # beyond the exponential's clamp
    close(cpu_fused.silu_and_mul(x), silu_and_mul_ref(x), dtype, scale=16.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("hidden", [640, 45])
def test_norm_add_norm_gives_the_bits_of_its_three_calls(generator, close, dtype, rows, strided, hidden):
    x = rows_view(generator, rows, hidden, dtype, strided, scale=3.0)
    residual = rows_view(generator, rows, hidden, dtype, strided, scale=10.0)
    w_post, w_pre = (1.0 + torch.randn(hidden, generator=generator)).to(dtype), torch.rand(hidden).to(dtype)
    out = torch.full((rows, hidden), 7.0, dtype=dtype)
    got_residual = residual.clone()
    cpu_fused.norm_add_norm(out, got_residual, x, w_post, w_pre, 1e-6)
    # The three calls it stands for: the compiled norm, torch's add, the compiled norm.
    normed = cpu_fused.rms_norm(x, w_post, 1e-6)
    want_residual = residual + normed
    assert torch.equal(got_residual, want_residual)
    assert torch.equal(out, cpu_fused.rms_norm(want_residual, w_pre, 1e-6))
    twin_residual, twin_out = norm_add_norm_ref(residual, x, w_post, w_pre, 1e-6)
    close(got_residual, twin_residual, dtype, scale=16.0)
    close(out, twin_out, dtype, scale=4.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 1, 256), (16, 8, 128), (3, 1, 6)])
def test_qk_norm_rotary_gives_the_bits_of_the_norms_and_the_rotation(
    generator, close, dtype, rows, heads, kv_heads, head_dim
):
    rotary = RotaryEmbedding(head_dim, 1024, 10000.0)
    positions = torch.randint(0, 1024, (rows,), generator=generator)
    qkv = rows_view(generator, rows, (heads + 2 * kv_heads) * head_dim, dtype, True, scale=3.0)
    q, k = qkv[:, : heads * head_dim], qkv[:, heads * head_dim : (heads + kv_heads) * head_dim]
    q_weight, k_weight = (1.0 + torch.randn(2, head_dim, generator=generator)).to(dtype)
    q_out, k_out = (
        torch.empty(rows, heads * head_dim, dtype=dtype),
        torch.empty(rows, kv_heads * head_dim, dtype=dtype),
    )
    before = qkv.clone()
    cpu_fused.qk_norm_rotary(
        positions, q_out, k_out, q, k, q_weight, k_weight, 1e-6, rotary.cos, rotary.sin, head_dim
    )
    assert torch.equal(qkv, before)  # the inputs are read only
    # The calls it stands for: the compiled norm per head, then the compiled rotation.
    want_q = cpu_fused.rms_norm(q.reshape(-1, head_dim), q_weight, 1e-6).reshape(rows, -1)
    want_k = cpu_fused.rms_norm(k.reshape(-1, head_dim), k_weight, 1e-6).reshape(rows, -1)
    cpu_fused.rotary_embedding(positions, want_q, want_k, rotary.cos, rotary.sin, head_dim)
    assert torch.equal(q_out, want_q) and torch.equal(k_out, want_k)
    twin_q, twin_k = qk_norm_rotary_ref(
        positions, q, k, q_weight, k_weight, 1e-6, rotary.cos, rotary.sin, head_dim
    )  # fmt: skip
    close(q_out, twin_q, dtype, scale=8.0)
    close(k_out, twin_k, dtype, scale=8.0)


def test_qk_norm_rotary_in_place_and_refusals():
    rotary = RotaryEmbedding(8, 16, 10000.0)
    q, k, w = torch.randn(1, 16), torch.randn(1, 8), torch.ones(8)
    want_q, want_k = q.clone(), k.clone()
    cpu_fused.qk_norm_rotary(
        torch.tensor([3]), want_q, want_k, q.clone(), k.clone(), w, w, 1e-6, rotary.cos, rotary.sin, 8
    )
    cpu_fused.qk_norm_rotary(torch.tensor([3]), q, k, q, k, w, w, 1e-6, rotary.cos, rotary.sin, 8)  # in place
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    qkv = torch.randn(1, 24)
    with pytest.raises(ValueError, match="shares no memory"):  # an output over the other input
        cpu_fused.qk_norm_rotary(
            torch.tensor([3]), qkv[:, 8:], k, qkv[:, :16], qkv[:, 16:], w, w, 1e-6, rotary.cos, rotary.sin, 8
        )
    with pytest.raises(ValueError, match="positions must lie"):
        cpu_fused.qk_norm_rotary(torch.tensor([16]), q, k, q, k, w, w, 1e-6, rotary.cos, rotary.sin, 8)
    with pytest.raises(ValueError, match="weights"):
        cpu_fused.qk_norm_rotary(
            torch.tensor([3]), q, k, q, k, torch.ones(7), w, 1e-6, rotary.cos, rotary.sin, 8
        )
    with pytest.raises(ValueError, match="even head_dim"):
        cpu_fused.qk_norm_rotary(torch.tensor([3]), q, k, q, k, w, w, 1e-6, rotary.cos, rotary.sin, 7)


def test_norm_add_norm_refuses_bad_arguments():
    x, residual, out, w = torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="must not overlap"):
        cpu_fused.norm_add_norm(x, residual, x, w, w, 1e-6)
    with pytest.raises(ValueError, match="must not overlap"):
        cpu_fused.norm_add_norm(out, residual, residual[:, :8], w, w, 1e-6)
    with pytest.raises(ValueError, match="weights"):
        cpu_fused.norm_add_norm(out, residual, x, torch.ones(7), w, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        cpu_fused.norm_add_norm(out, torch.zeros(3, 8), x, w, w, 1e-6)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_fused.norm_add_norm(out.double(), residual.double(), x.double(), w.double(), w.double(), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("inner", [2048, 45])  # Gemma 3 270M's; a tail past the vectors
def test_gelu_tanh_and_mul_matches_twin(generator, close, dtype, rows, strided, inner):
    x = rows_view(generator, rows, 2 * inner, dtype, strided, scale=4.0)
    x[0, 0], x[0, 1], x[0, 2] = -200.0, 200.0, 1e-30  # beyond the exponential's clamp; near 0
    x[0, inner + 2] = 1e30
    got, want = cpu_fused.gelu_tanh_and_mul(x), gelu_tanh_and_mul_ref(x)
    close(got, want, dtype, scale=float(want.float().abs().max()))  # within a few of the dtype's steps
    if dtype == torch.float32:
        # Relative to the exact value (float64), where torch's 1 + tanh cancels to 0 for gates below
        # about -5 and the kernel's sigmoid form keeps its digits.
        gate, up = x.double().chunk(2, dim=-1)
        exact = gate * torch.sigmoid(2 * 0.7978845608028654 * (gate + 0.044715 * gate**3)) * up
        assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-33)  # the clamp leaves |g u| e^-88


def test_gemmas_mlp_runs_the_compiled_geglu(generator):
    from services.worker.layers.activation import GeluTanhAndMul, gelu_tanh_and_mul

    act = GeluTanhAndMul()
    assert act._cpu_fused
    x = torch.randn(3, 64, generator=generator)
    assert torch.equal(act(x), cpu_fused.gelu_tanh_and_mul(x))
    act._cpu_fused = False
    assert torch.equal(act(x), gelu_tanh_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("head_dim", [64, 6])
def test_rotary_matches_twin_on_views_of_one_projection(generator, close, dtype, rows, head_dim):
    heads, kv_heads = 9, 3
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    v_before = v.clone()
    positions = torch.randint(0, 4096, (rows,), generator=generator)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, rotary.cos, rotary.sin, head_dim)
    cpu_fused.rotary_embedding(positions, q, k, rotary.cos, rotary.sin, head_dim)
    close(q, q_ref, dtype, scale=4.0)
    close(k, k_ref, dtype, scale=4.0)
    assert torch.equal(v, v_before)  # the rest of the projection is untouched


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(
    "cols", [1, 31, 32, 33, 95, 49152, 262144]
)  # around the kernel's vectors; vocabularies
@pytest.mark.parametrize("strided", [False, True])
def test_argmax_rows_matches_twin(generator, rows, cols, strided):
    if rows * cols > 5_000_000:
        rows = 3
    x = rows_view(generator, rows, cols, torch.float32, strided)
    # Ties: a row's maximum copied later in it (the first wins), and a row of -inf.
    x[0, cols // 2] = x[0].max() + 1.0
    x[0, cols - 1] = x[0, cols // 2]
    if rows > 1:
        x[1] = float("-inf")
    assert torch.equal(cpu_fused.argmax_rows(x), argmax_rows_ref(x))


@pytest.mark.parametrize(
    "special, want",
    [
        ({5: float("nan"), 40: float("nan"), 7: float("inf")}, 5),  # the first NaN, whatever else
        ({70: float("inf"), 9: float("inf")}, 9),  # the first of two +inf
        ({63: 100.0, 64: 100.0}, 63),  # a tie across the kernel's chunks of 32
        ({99: float("nan")}, 99),  # a NaN in the scalar tail
    ],
)
def test_argmax_rows_nan_inf_and_ties(generator, special, want):
    x = torch.randn(2, 100, generator=generator)
    for i, v in special.items():
        x[1, i] = v
    got = cpu_fused.argmax_rows(x)
    assert got[1] == want and torch.equal(got, argmax_rows_ref(x))


def test_argmax_rows_refuses_bad_arguments():
    with pytest.raises(ValueError, match="float32 CPU tensor"):
        cpu_fused.argmax_rows(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous in its rows"):
        cpu_fused.argmax_rows(torch.zeros(8, 2).t())
    with pytest.raises(ValueError, match=r"\[rows, n\], n > 0"):
        cpu_fused.argmax_rows(torch.zeros(2, 0))
    with pytest.raises(ValueError, match=r"\[rows, n\]"):
        cpu_fused.argmax_rows(torch.zeros(8))


def test_greedy_sampling_takes_the_kernel_where_its_owner_chose_it(monkeypatch):
    from services.worker import sampler

    taken = []
    monkeypatch.setattr(cpu_fused, "argmax_rows", lambda x: taken.append(x.shape) or argmax_rows_ref(x))
    logits = torch.randn(3, 50)
    assert torch.equal(sampler.argmax_rows(logits, compiled=True), logits.argmax(dim=-1)) and taken == [
        (3, 50)
    ]
    assert torch.equal(sampler.argmax_rows(logits.double(), compiled=True), logits.argmax(dim=-1))
    assert torch.equal(sampler.argmax_rows(logits), logits.argmax(dim=-1))  # not chosen: torch's
    assert len(taken) == 1


def test_empty_batches_are_no_ops():
    assert cpu_fused.argmax_rows(torch.empty(0, 49152)).shape == (0,)
    x = torch.empty(0, 576)
    cpu_fused.fused_add_rms_norm(x, torch.empty(0, 576), torch.ones(576), 1e-5)
    assert cpu_fused.silu_and_mul(torch.empty(0, 8)).shape == (0, 4)
    assert cpu_fused.rms_norm(x, torch.ones(576), 1e-5).shape == (0, 576)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: (torch.zeros(4, 8), torch.zeros(4, 8), torch.ones(7)), "weight must be"),
        (lambda: (torch.zeros(4, 8), torch.zeros(3, 8), torch.ones(8)), "residual must be"),
        (
            lambda: (torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16), torch.ones(8)),
            "residual must be",
        ),
        (
            lambda: (torch.zeros(4, 8, dtype=torch.float16),) * 2 + (torch.ones(8, dtype=torch.float16),),
            "x must be one of",
        ),
        (lambda: (torch.zeros(8, 4).t(), torch.zeros(4, 8), torch.ones(8)), "x must be contiguous"),
        (lambda: (torch.zeros(4, 2, 4), torch.zeros(4, 2, 4), torch.ones(4)), r"x must be \[T, N\]"),
    ],
)
def test_fused_add_rms_norm_refuses_bad_arguments(make, message):
    x, residual, weight = make()
    with pytest.raises(ValueError, match=message):
        cpu_fused.fused_add_rms_norm(x, residual, weight, 1e-5)


@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
def test_silu_and_mul_refuses_bad_arguments(op):
    with pytest.raises(ValueError, match=r"x must be \[T, 2I\]"):
        getattr(cpu_fused, op)(torch.zeros(4, 7))
    with pytest.raises(ValueError, match="x must be one of"):
        getattr(cpu_fused, op)(torch.zeros(4, 8, dtype=torch.float64))


def test_rotary_refuses_bad_arguments():
    rotary = RotaryEmbedding(8, 16, 10000.0)
    q, k = torch.zeros(2, 16), torch.zeros(2, 8)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 16\)"):
        cpu_fused.rotary_embedding(torch.tensor([0, 16]), q, k, rotary.cos, rotary.sin, 8)
    with pytest.raises(ValueError, match="head_dim must be even"):
        cpu_fused.rotary_embedding(torch.tensor([0, 1]), q, k, rotary.cos, rotary.sin, 7)
    with pytest.raises(ValueError, match="key must be"):
        cpu_fused.rotary_embedding(torch.tensor([0, 1]), q, torch.zeros(3, 8), rotary.cos, rotary.sin, 8)
    # Unchecked from Python, the kernel still refuses what would read outside the tables.
    with pytest.raises(RuntimeError, match="positions must lie"):
        cpu_fused.rotary_embedding(torch.tensor([0, 99]), q, k, rotary.cos, rotary.sin, 8, check=False)


def test_env_switch_turns_the_path_off(monkeypatch, caplog):
    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "0")
    cpu_fused.available.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="kernels.cpu_fused"):
            assert cpu_fused.available() is False
        assert "fused CPU kernels off" in caplog.text
        monkeypatch.setenv(cpu_fused.ENV_SWITCH, "maybe")
        cpu_fused.available.cache_clear()
        with pytest.raises(ValueError, match="WEFT_CPU_FUSED must be 0 or 1"):
            cpu_fused.available()
    finally:
        cpu_fused.available.cache_clear()


def test_a_failed_build_is_logged_and_falls_back(monkeypatch, caplog):
    def fail():
        raise cpu_fused.KernelUnavailable("building the fused CPU kernels needs c++ on PATH")

    monkeypatch.setenv(cpu_fused.ENV_SWITCH, "1")
    monkeypatch.setattr(cpu_fused, "load", fail)
    cpu_fused.available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kernels.cpu_fused"):
            assert cpu_fused.available() is False
        assert "fall back to torch ops" in caplog.text
    finally:
        cpu_fused.available.cache_clear()


def _layers(monkeypatch, switch: str, dtype: torch.dtype):
    from services.worker.layers.activation import SiluAndMul
    from services.worker.layers.norm import RMSNorm

    monkeypatch.setenv(cpu_fused.ENV_SWITCH, switch)
    cpu_fused.available.cache_clear()
    try:
        norm = RMSNorm(576, 1e-5, dtype)
        rotary = RotaryEmbedding(64, 512, 10000.0)
        act = SiluAndMul()
    finally:
        cpu_fused.available.cache_clear()
    norm.weight.data = torch.linspace(0.5, 1.5, 576).to(dtype)
    return norm, rotary, act


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_layers_with_and_without_the_fused_path_agree(generator, close, monkeypatch, dtype):
    """The layers pick the kernels at construction; the results are the torch path's."""
    fused_norm, fused_rotary, fused_act = _layers(monkeypatch, "1", dtype)
    torch_norm, torch_rotary, torch_act = _layers(monkeypatch, "0", dtype)
    assert (fused_norm._cpu_fused, fused_rotary._cpu_fused, fused_act._cpu_fused) == (True, True, True)
    assert (torch_norm._cpu_fused, torch_rotary._cpu_fused, torch_act._cpu_fused) == (False, False, False)
    x, residual = (
        torch.randn(5, 576, generator=generator).to(dtype),
        torch.randn(5, 576, generator=generator).to(dtype),
    )
    expected_out, expected_residual = torch_norm(x.clone(), residual.clone())
    out, new_residual = fused_norm(x.clone(), residual.clone())
    close(out, expected_out, dtype, scale=4.0)
    assert torch.equal(new_residual, expected_residual)
    close(fused_norm(x), torch_norm(x), dtype, scale=4.0)

    qkv = torch.randn(5, 15 * 64, generator=generator).to(dtype)
    positions = torch.tensor([0, 7, 100, 3, 511])
    q, k, _ = qkv.clone().split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    expected_q, expected_k = torch_rotary(positions, *[t.clone() for t in (q, k)])
    got_q, got_k = fused_rotary(positions, q, k)
    close(got_q, expected_q, dtype, scale=4.0)
    close(got_k, expected_k, dtype, scale=4.0)

    gate_up = torch.randn(5, 2 * 1536, generator=generator).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    close(fused_act(gate_up), torch.nn.functional.silu(gate) * up, dtype, scale=8.0)
    close(torch_act(gate_up), torch.nn.functional.silu(gate) * up, dtype, scale=8.0)
