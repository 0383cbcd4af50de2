"""Weights kept quantized with a dense copy for batched steps (``dense_min_rows``, opt-in).

By default no copy is kept: the packed weights run every step. Asked for,
steps of fewer rows than ``dense_min_rows`` run the packed kernels; from there
on each linear layer runs its dense copy (oneDNN's GEMM in the model's dtype),
which holds exactly the dequantized weight. The choice is validated at config time.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest
import torch

from kernels.reference import quantize_rows_i8_ref, quantize_rows_int8_ref, scale_int32_ref
from services.config import engine_args
from services.config.cli_args import add_engine_args, engine_args_from
from services.config.dense_copy import (
    AMX_INT8_MAX_ROWS,
    AVX2_INT8_DENSE_MIN_ROWS,
    DEFAULT_DENSE_MIN_ROWS,
    INT8_MIN_ROWS,
    OWN_INT8_GEMM_DENSE_MIN_ROWS,
    linear_param_count,
    resolve_dense_min_rows,
)
from services.config.engine_args import EngineArgs
from services.model_files import resolve
from services.worker.layers.linear import LinearBase, pack_linear_weights, packed_weights_bytes
from services.worker.layers.quantized_linear import quantized_report
from services.worker.model_loader import load_model

# Llama-3-8B's shapes: 7.0e9 weights in its linear layers, far over the auto limit.
LLAMA_8B = dict(
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    num_hidden_layers=32,
    vocab_size=128256,
)


def config_of(**kwargs):
    return EngineArgs(device="cpu", **kwargs).create_engine_config().model


def test_auto_keeps_no_copy_an_explicit_count_keeps_one():
    """One copy of the weights and batch-invariant numerics by default, at every model size."""
    assert config_of(dtype="float32").dense_min_rows == 0
    assert config_of(dtype="auto").dense_min_rows == 0
    assert config_of(dtype="float32", dense_min_rows=0).dense_min_rows == 0
    assert config_of(dtype="float32", dense_min_rows=32).dense_min_rows == 32
    assert config_of(dtype="float32", quantization="none").dense_min_rows == 0  # dense already
    assert resolve_dense_min_rows(None, "gguf") == 0
    assert resolve_dense_min_rows(16, "gguf") == 16  # asked for: kept
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
    assert config_of(dtype="float32", speculative_config=spec).dense_min_rows == 0
    assert config_of(dtype="float32", speculative_config=spec, dense_min_rows=8).dense_min_rows == 8


def test_a_copy_dtype_asked_for_alone_asks_for_the_copy():
    assert config_of(dtype="float32", dense_copy_dtype="model").dense_min_rows == DEFAULT_DENSE_MIN_ROWS
    int8 = config_of(dtype="float32", dense_copy_dtype="int8")
    assert int8.dense_copy_dtype == "int8" and int8.dense_min_rows >= 1


def test_bad_values_are_refused_clearly():
    with pytest.raises(ValueError, match="dense_min_rows must be 0"):
        config_of(dense_min_rows=-1)
    with pytest.raises(ValueError, match="every weight is dense already"):
        config_of(quantization="none", dense_min_rows=8)


def test_the_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(
        parser.parse_args(["--dense-min-rows", "0", "--device", "cpu", "--dtype", "fp32"])
    )
    assert args.create_engine_config().model.dense_min_rows == 0


@pytest.fixture(scope="module")
def model():
    """The default model kept quantized with a copy from 8 rows, packed for oneDNN as the CPU worker does."""
    torch.set_num_threads(1)
    config = config_of(dtype="float32", dense_min_rows=8)
    loaded = load_model(config)
    pack_linear_weights(loaded, torch.float32, torch.device("cpu"))
    return loaded


def linear_layers(model) -> list[LinearBase]:
    return [m for m in model.modules() if isinstance(m, LinearBase)]


def test_the_param_count_is_the_models_own(model):
    """The estimate "auto" decides on counts exactly the weights the layers hold (the head once)."""
    assert linear_param_count(resolve(None).hf_config()) == quantized_report(model).total_params


@torch.inference_mode()
def test_fewer_rows_run_packed_more_run_the_dense_copy(model):
    for layer in linear_layers(model)[:8] + [model.lm_head]:
        assert layer.quant is not None and layer.packed_weight is not None
        k = layer.quant.shape[1]
        for rows in (1, 7):
            x = torch.randn(rows, k)
            assert torch.equal(layer.linear(x, None), layer.quant.linear(x, None))
        for rows in (8, 64):
            x = torch.randn(rows, k)
            dense = torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, None, "none", [], "")
            assert torch.equal(layer.linear(x, None), dense)
            # The copy is the dequantized weight: on x rounded as the packed path rounds it (int8
            # per group by default), the two paths agree up to the order of fp32 sums.
            rounded = torch.ops.mkldnn._linear_pointwise(
                rounded_as_packed(x, layer), layer.packed_weight, None, "none", [], ""
            )
            torch.testing.assert_close(rounded, layer.quant.linear(x, None), atol=2e-3, rtol=2e-3)


def rounded_as_packed(x: torch.Tensor, layer) -> torch.Tensor:
    """``x`` rounded per weight group to the integers the packed kernel uses, back in fp32."""
    from services.worker.layers.quantized_linear import activations_from_env

    activations = activations_from_env()
    if activations == "fp32":
        return x
    dtype = torch.int8 if activations == "int8" else torch.int16
    q, d = quantize_rows_i8_ref(x, layer.quant.parts[0].group_size, dtype)
    return (q.float() * d[..., None]).flatten(1)


def test_the_copy_is_counted_and_the_embedding_stays_packed(model):
    """The tied head's copy is its own: the embedding still looks rows up in the packed weight."""
    head, embedding = model.lm_head, model.model.embed_tokens
    assert embedding.weight is None and embedding.quant is head.quant
    dense_bytes = sum(m.packed_bytes for m in linear_layers(model))
    assert dense_bytes == 4 * quantized_report(model).total_params  # one fp32 copy of every weight
    ids = torch.tensor([0, 5, 49151])
    torch.testing.assert_close(embedding(ids), head.quant.dequantize()[ids])


@torch.inference_mode()
def test_a_bf16_model_keeps_a_bf16_copy():
    loaded = load_model(config_of(dtype="bfloat16", dense_min_rows=4, dense_copy_dtype="model"))
    layer = linear_layers(loaded)[0]
    assert layer.weight.dtype == torch.bfloat16
    x = torch.randn(4, layer.quant.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    want = x.float() @ layer.quant.dequantize().T
    # The copy's bf16 weights and sums err by up to ~0.2 on outputs of up to ~90 (seeds 0-19), on
    # small outputs as on large ones: the bound is a share of the largest. A wrong weight errs by tens.
    torch.testing.assert_close(
        layer.linear(x, None).float(), want, atol=0.01 * want.abs().max().item(), rtol=0.05
    )


SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'


def test_an_int8_copy_comes_beside_the_model_dtype_copy_when_asked_for():
    assert config_of(dtype="float32").dense_copy_dtype == "model"
    assert config_of(dtype="float32", dense_copy_dtype="int8").dense_copy_dtype == "int8"
    assert config_of(dtype="float32", speculative_config=SPEC, dense_min_rows=8, dense_copy_dtype="int8")


@pytest.fixture
def int8_pays(monkeypatch):
    """What auto decides on a CPU where the int8 copy pays on VNNI dot products (flags fed in,
    not this machine's)."""
    monkeypatch.setattr(engine_args, "cpu_int8_copy_pays", lambda flags=None: True)
    monkeypatch.setattr(engine_args, "cpu_own_int8_gemm", lambda flags=None: False)


def test_where_wefts_own_int8_gemm_runs_the_int8_copy_starts_at_two_rows(monkeypatch):
    """AMX int8 tiles or AVX-512 VNNI (flags fed in, not this machine's)."""
    monkeypatch.setattr(engine_args, "cpu_int8_copy_pays", lambda flags=None: True)
    monkeypatch.setattr(engine_args, "cpu_own_int8_gemm", lambda flags=None: True)
    first_rows = engine_args.own_int8_gemm_first_rows
    monkeypatch.setattr(
        engine_args, "own_int8_gemm_first_rows", lambda flags=None: first_rows({"avx512_vnni"})
    )
    assert config_of(dtype="bfloat16").dense_min_rows == 0  # nothing asked for: no copy
    both = config_of(dtype="bfloat16", dense_copy_dtype="int8")
    assert (both.dense_copy_dtype, both.dense_min_rows) == ("int8", OWN_INT8_GEMM_DENSE_MIN_ROWS)
    # The bf16 copy alone starts where it beat the packed kernels; an explicit count is kept.
    assert config_of(dtype="bfloat16", dense_copy_dtype="model").dense_min_rows == DEFAULT_DENSE_MIN_ROWS
    sixteen = config_of(dtype="bfloat16", dense_min_rows=16)
    assert (sixteen.dense_copy_dtype, sixteen.dense_min_rows) == ("int8", 16)


def test_the_fp32_that_dtype_auto_picks_adds_an_int8_copy_where_wefts_own_gemm_runs(monkeypatch):
    """A CPU without bf16 math (AVX2 alone; flags fed in, not this machine's): with a copy asked
    for and dtype auto (fp32), weft's own int8 GEMM brings the int8 copy beside the fp32 one; an
    fp32 asked for stays fp32 at every step (the HF parity tests), as does auto without the GEMM."""
    monkeypatch.setattr(engine_args, "cpu_has_fast_bf16", lambda flags=None: False)
    monkeypatch.setattr(engine_args, "cpu_int8_copy_pays", lambda flags=None: False)
    monkeypatch.setattr(engine_args, "cpu_own_int8_gemm", lambda flags=None: True)
    first_rows = engine_args.own_int8_gemm_first_rows
    monkeypatch.setattr(engine_args, "own_int8_gemm_first_rows", lambda flags=None: first_rows({"avx2"}))
    assert config_of(dtype="auto").dense_min_rows == 0
    auto = config_of(dtype="auto", dense_copy_dtype="int8")
    assert (auto.dtype, auto.dense_copy_dtype, auto.dense_min_rows) == (
        "float32",
        "int8",
        AVX2_INT8_DENSE_MIN_ROWS,
    )
    assert config_of(dtype="auto", dense_min_rows=4).dense_copy_dtype == "int8"
    asked = config_of(dtype="float32", dense_min_rows=4)
    assert (asked.dense_copy_dtype, asked.dense_min_rows) == ("model", 4)
    assert config_of(dtype="auto", dense_copy_dtype="model").dense_copy_dtype == "model"
    assert config_of(dtype="auto", dense_min_rows=4, tensor_parallel_size=3).dense_copy_dtype == "model"
    monkeypatch.setattr(engine_args, "cpu_own_int8_gemm", lambda flags=None: False)
    assert config_of(dtype="auto", dense_min_rows=4).dense_copy_dtype == "model"


def test_auto_adds_the_int8_copy_beside_a_bf16_one_where_it_pays(int8_pays):
    both = config_of(dtype="bfloat16", dense_min_rows=8)
    assert (both.dense_copy_dtype, both.dense_min_rows) == ("int8", 8)
    assert config_of(dtype="bfloat16", dense_copy_dtype="model").dense_copy_dtype == "model"
    # fp32 stays exact (HF parity); several workers would round their shards' rows differently.
    assert config_of(dtype="float32", dense_min_rows=8).dense_copy_dtype == "model"
    assert config_of(dtype="bfloat16", dense_min_rows=8, tensor_parallel_size=3).dense_copy_dtype == "model"
    # No copy kept (none asked for): no int8 copy, no refusal.
    assert config_of(dtype="bfloat16", speculative_config=SPEC).dense_copy_dtype == "model"
    assert config_of(dtype="bfloat16", dense_min_rows=0).dense_copy_dtype == "model"


def test_auto_keeps_the_model_dtype_copy_alone_where_int8_does_not_pay(monkeypatch):
    monkeypatch.setattr(engine_args, "cpu_int8_copy_pays", lambda flags=None: False)
    monkeypatch.setattr(engine_args, "cpu_own_int8_gemm", lambda flags=None: False)
    assert config_of(dtype="bfloat16", dense_min_rows=8).dense_copy_dtype == "model"
    assert config_of(dtype="bfloat16", dense_copy_dtype="int8").dense_copy_dtype == "int8"  # asked for


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dense_copy_dtype="fp8"), "dense_copy_dtype must be one of auto, model, int8"),
        (dict(dense_copy_dtype="int8", quantization="none"), "no packed weight to copy"),
        (dict(dense_copy_dtype="int8", dense_min_rows=0), "no copy is kept"),
    ],
)
def test_an_int8_copy_where_none_is_kept_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        config_of(dtype="float32", **kwargs)


def test_the_int8_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--dense-copy-dtype", "int8", "--device", "cpu"]))
    assert args.create_engine_config().model.dense_copy_dtype == "int8"


@pytest.fixture(scope="module")
def int8_model():
    torch.set_num_threads(1)
    loaded = load_model(config_of(dtype="float32", dense_min_rows=8, dense_copy_dtype="int8"))
    pack_linear_weights(loaded, torch.float32, torch.device("cpu"))
    return loaded


def int8_weight_twin(layer: LinearBase) -> tuple[torch.Tensor, torch.Tensor]:
    """W rotated and rounded per row, as the int8 copy holds it (by the twins)."""
    assert layer.int8.hadamard_block == 64  # every width of the default model is a multiple of 64
    return quantize_rows_int8_ref(layer.quant.dequantize(), 64)


@pytest.fixture(scope="module")
def int8_twins() -> Iterator[dict]:
    """Each layer's dequantized weight and ``int8_weight_twin``, computed once for both dtypes'
    cases (the LM head's are 49152 rows)."""
    twins: dict[LinearBase, tuple] = {}
    yield twins
    twins.clear()


def int8_twin(weight_twin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The int8 copy's computation from the twins: x rotated and rounded per row, an exact
    integer product with ``int8_weight_twin``'s W.

    The product is taken in fp64, where every sum of these int8 products is an exact integer
    (|sum| <= K * 127**2, far below 2**53): the same int32 numbers as ``torch._int_mm``, which
    without VNNI is a scalar loop (seconds a call at the LM head's 49152 rows)."""
    qw, sw = weight_twin
    qx, sx = quantize_rows_int8_ref(x, 64)
    product = (qx.double() @ qw.double().t()).to(torch.int32)
    return scale_int32_ref(product, sx, sw, None, x.dtype)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_copy_runs_the_rows_its_gemm_takes(int8_model, int8_twins, dtype):
    """Under 8 rows the packed kernels; from there the int8 copy where its GEMM takes the rows
    (``Int8Weight.takes``: from INT8_MIN_ROWS on, up to AMX_INT8_MAX_ROWS on weft's AMX GEMM, or
    every count on its VNNI GEMM, whichever this CPU has), else the model dtype's copy."""
    for layer in linear_layers(int8_model)[:8] + [int8_model.lm_head]:
        assert layer.packed_weight is not None and layer.int8 is not None
        k = layer.quant.shape[1]
        x = torch.randn(7, k).to(dtype)
        assert torch.equal(layer.linear(x, None), layer.quant.linear(x, None))
        if layer not in int8_twins:
            int8_twins[layer] = layer.quant.dequantize(), int8_weight_twin(layer)
        weight, weight_twin = int8_twins[layer]
        for rows in (
            8,
            INT8_MIN_ROWS - 1,
            INT8_MIN_ROWS,
            INT8_MIN_ROWS + 37,
            AMX_INT8_MAX_ROWS,
            AMX_INT8_MAX_ROWS + 1,
        ):
            x = torch.randn(rows, k).to(dtype)
            if not layer.int8.takes(rows):
                if dtype == torch.float32:  # (the model's dtype: its copy is fp32)
                    dense = torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, None, "none", [], "")
                    assert torch.equal(layer.linear(x, None), dense)
                continue
            got = layer.linear(x, None)
            assert got.dtype == dtype
            assert torch.equal(got, int8_twin(weight_twin, x))
            # Both roundings together: about 1% of the product (x's step, amax / 127, is about
            # 3% of a Gaussian row's spread; its rounding error a third of that).
            want = x.float() @ weight.T
            assert float((got.float() - want).norm() / want.norm()) < 0.03
    taken = [layer.int8.takes(rows) for rows in (8, 300)]
    # weft's VNNI and AVX2 GEMMs take both ends, its AMX GEMM the short steps, the others the long ones
    expected = {"vnni": [True, True], "avx2": [True, True], "amx": [True, False]}
    assert taken == expected.get(layer.int8.gemm, [False, True])


@torch.inference_mode()
def test_an_mlp_on_both_int8_copies_runs_one_pass_between_them(int8_model, monkeypatch):
    """Where both int8 copies take the rows the MLP goes from the gate/up GEMM's int32 result to
    the down GEMM's int8 input in one kernel, with the same output as the layers one after the other
    (except where each copy's linear is one call, on the AVX2 GEMM: three calls then beat four)."""
    from kernels import cpu_fused

    mlp = int8_model.model.layers[0].mlp
    calls = []
    fused = cpu_fused.scale_silu_quantize_int8
    monkeypatch.setattr(cpu_fused, "scale_silu_quantize_int8", lambda *a: calls.append(a) or fused(*a))
    for rows in (INT8_MIN_ROWS - 1, INT8_MIN_ROWS, 300):
        x = torch.randn(rows, mlp.gate_up_proj.quant.shape[1])
        apart = mlp.down_proj(mlp.act_fn(mlp.gate_up_proj(x)))
        calls.clear()
        assert torch.equal(mlp(x), apart)
        copy = mlp.gate_up_proj.int8
        assert len(calls) == (copy.takes(rows) and not copy.one_call)


def test_the_int8_copy_is_counted(int8_model):
    report = quantized_report(int8_model)
    layers = linear_layers(int8_model)
    rows = sum(layer.quant.shape[0] for layer in layers)
    # The fp32 copy, and beside it the int8 weights with one fp32 scale a row (and on weft's VNNI
    # GEMM one int32 a row, where its sums start).
    sums = sum(4 * layer.quant.shape[0] for layer in layers if layer.int8.gemm == "vnni")
    assert packed_weights_bytes(int8_model) == 4 * report.total_params + report.total_params + 4 * rows + sums


def test_no_int8_copy_where_its_gemm_would_be_a_scalar_loop(monkeypatch, caplog):
    """Auto chose the copy from the CPU's flags, but weft's AVX2 kernel is missing here (no compiler,
    or turned off): the model dtype's copy alone, from DEFAULT_DENSE_MIN_ROWS rows, and a warning."""
    from services.worker.layers import quantized_linear

    monkeypatch.setattr(quantized_linear, "int8_copy_runs_here", lambda: False)
    loaded = load_model(config_of(dtype="float32", dense_min_rows=1, dense_copy_dtype="int8"))
    layers = [layer for layer in linear_layers(loaded) if layer.quant is not None]
    assert layers and all(layer.int8 is None for layer in layers)
    assert all(
        layer.dense_min_rows == DEFAULT_DENSE_MIN_ROWS and layer.weight is not None for layer in layers
    )
    assert "No int8 dense copy" in caplog.text
