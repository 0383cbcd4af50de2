"""The lean decode path (``services.worker.models.lean_decode``) gives the module path's numbers
bit for bit: hidden states, residual stream and the KV cache it writes, on decode steps of one
and of four sequences, a speculative verify step and a short prompt beside a decode, for packed GGUF weights (the default: Q4_1, the default model's type; the
Q4_K_M mix, whose layer 1 fuses a Q4_K and a Q6_K part into its QKV projection; a Qwen2 with QKV
biases and a Qwen3 with QK-norm) and for the AVX2 int8 copy; Gemma 3's layers (``lean_gemma3``) on
Gemma 3 270M as its Q4_K_M file holds it, window layers in their own KV cache group, contexts past
the window included; and it runs only on the steps and models it was written for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import cpu_avx2_int8, cpu_fused
from services.config.engine_args import EngineArgs
from services.model_files import models_dir, resolve
from services.worker.forward_context import set_forward_context
from services.worker.layers.attention import kv_cache_shape
from services.worker.layers.attention_metadata import PrefillCaps, build_attention_metadata
from services.worker.layers.int8_linear import Int8Weight
from services.worker.model_loader import load_model
from services.worker.models import lean_decode
from services.worker.models.lean_decode import ENV_SWITCH, LeanDecode
from tests.utils import gguf_parsed_once

pytestmark = pytest.mark.skipif(
    not (cpu_avx2_int8.available() and cpu_fused.available()), reason="needs AVX2 and weft's CPU kernels"
)

BLOCK = 16
CONTEXTS = [5, 20, 40, 16]  # tokens cached before the step, per sequence
# Packed files by name: (make-model shape, GGUF type).
PACKED = {
    "Q4_1": ("tiny-llama", "Q4_1"),
    "Q4_K_M": ("tiny-llama", "Q4_K_M"),
    "qwen2-bias": ("tiny-qwen2", "Q4_0"),  # QKV biases
    "qwen3-qk-norm": ("tiny-qwen3", "Q4_0"),  # RMSNorm over each head of Q and K
}
MODELS = ("int8-copy", *PACKED)


def _linears(layer):
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


@pytest.fixture(scope="module")
def model(tmp_path_factory, make_engine_config, make_tiny_hf_model):
    """A tiny random Llama (in_features multiples of 64, as the AVX2 kernel packs) with an int8 copy
    beside every linear layer, on the AVX2 kernel."""
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-lean"), intermediate_size=128)
    config = make_engine_config(str(path), str(path), max_model_len=256)
    model = load_model(config.model)
    for layer in model.model.layers:
        for linear in _linears(layer):
            linear.int8 = Int8Weight(linear.weight.detach(), gemm="avx2")
            assert linear.int8.one_call
    return model


@pytest.fixture(scope="module")
def packed_models(tmp_path_factory):
    """``weft bench make-model``'s tiny Llama by GGUF type, loaded at the defaults (packed, fp32)."""
    from benchmarks.bench.make_model import write_model

    models = {}
    for name, (shape, qtype) in PACKED.items():
        path = tmp_path_factory.mktemp("lean-gguf") / f"{shape}-{qtype.lower()}.gguf"
        with gguf_parsed_once():
            write_model(shape, qtype, path, log=lambda *args: None)
            resolve(str(path))
        models[name] = load_model(EngineArgs(model=str(path), dtype="float32").create_engine_config().model)
    return models


@pytest.fixture(params=MODELS)
def any_model(request, packed_models):
    return request.getfixturevalue("model") if request.param == "int8-copy" else packed_models[request.param]


def _step(contexts: list[int], query_lens: list[int] | None = None, prefill_caps=None):
    """Metadata of one step, each sequence in blocks of its own; ids and positions."""
    query_lens = query_lens or [1] * len(contexts)
    width = max(-(-(c + q) // BLOCK) for c, q in zip(contexts, query_lens))
    table = np.zeros((len(contexts), width), np.int32)
    slots, positions, next_block = [], [], 1
    for i, (context, count) in enumerate(zip(contexts, query_lens)):
        blocks = -(-(context + count) // BLOCK)
        table[i, :blocks] = np.arange(next_block, next_block + blocks)
        next_block += blocks
        for pos in range(context, context + count):
            slots.append(table[i, pos // BLOCK] * BLOCK + pos % BLOCK)
            positions.append(pos)
    meta = build_attention_metadata(
        query_lens=np.array(query_lens),
        context_lens=np.array(contexts),
        block_table=table,
        slot_mapping=np.array(slots),
        block_size=BLOCK,
        paged_decodes=True,
        prefill_caps=prefill_caps,
    )
    ids = torch.tensor([(7 * p + 3) % 256 for p in positions])
    return meta, ids, torch.tensor(positions)


def _caches(model, seed: int) -> list[torch.Tensor]:
    args = model.args
    generator = torch.Generator().manual_seed(seed)
    shape = kv_cache_shape(32, BLOCK, args.num_kv_heads, args.head_dim)
    return [torch.randn(shape, generator=generator) for _ in range(args.num_layers)]


STEPS = {  # (tokens cached per sequence, new tokens per sequence)
    "four-rows": (CONTEXTS, None),
    "one-row": ([33], None),
    "verify": ([20, 33], [5, 5]),  # four drafts and the token before them, per sequence
    "prompt-beside-a-decode": ([0, 20], [6, 1]),
}


@pytest.mark.parametrize("step", list(STEPS))
@torch.inference_mode()
def test_lean_steps_give_the_module_paths_bits(any_model, step):
    model = any_model
    contexts, query_lens = STEPS[step]
    meta, ids, positions = _step(contexts, query_lens)
    inner = model.model
    caches = {name: _caches(model, 0) for name in ("modules", "lean")}
    with set_forward_context(meta, caches["modules"], backend="cpu"):
        x, residual = inner.embed_tokens(ids), None
        for layer in inner.layers:
            x, residual = layer(positions, x, residual)
    with set_forward_context(meta, caches["lean"], backend="cpu") as context:
        embedded = inner.embed_tokens(ids)
        assert inner.lean.runs(len(ids), embedded, context)
        lean_x, lean_residual = inner.lean.forward(embedded, positions, context)
    assert torch.equal(lean_x, x) and torch.equal(lean_residual, residual)
    for ours, theirs in zip(caches["lean"], caches["modules"]):
        assert torch.equal(ours, theirs)
    # And the model's forward takes it: the same hidden states as the module path's, normed.
    with set_forward_context(meta, _caches(model, 0), backend="cpu"):
        hidden = model(ids, positions)
    assert torch.equal(hidden, inner.norm(x, residual=residual)[0])


def test_the_packed_files_hold_what_the_cases_above_are_for(packed_models):
    """A QKV projection of two formats (the lean path's call per part, into its columns), QKV
    biases, QK-norm."""
    qkv = packed_models["Q4_K_M"].model.layers[1].self_attn.qkv_proj.quant
    assert [p.source_format for p in qkv.parts] == ["Q4_K", "Q6_K"]
    assert packed_models["qwen2-bias"].model.layers[0].self_attn.qkv_proj.bias is not None
    assert hasattr(packed_models["qwen3-qk-norm"].model.layers[0].self_attn, "q_norm")


@torch.inference_mode()
def test_only_steps_on_the_paged_cpu_kernels_run_lean(model):
    inner = model.model
    meta, ids, _ = _step(CONTEXTS)
    x = inner.embed_tokens(ids)
    with set_forward_context(meta, _caches(model, 1), backend="cpu") as context:
        assert inner.lean.runs(len(ids), x, context)
        assert not inner.lean.runs(len(ids), x.bfloat16(), context)
    with set_forward_context(meta, _caches(model, 1), backend="torch") as context:
        assert not inner.lean.runs(len(ids), x, context)
    with (
        set_forward_context(meta, _caches(model, 1), backend="cpu") as context,
        pytest.MonkeyPatch.context() as mp,
    ):
        mp.setattr(lean_decode, "MAX_ROWS", len(ids) - 1)  # a step larger than it: the modules
        assert not inner.lean.runs(len(ids), x, context)
    with set_forward_context(meta, None, backend="cpu") as context:  # profiling, before the cache
        assert not inner.lean.runs(len(ids), x, context)
    with set_forward_context(meta, _caches(model, 1), backend="cpu", kv_scales=[None]) as context:
        assert not inner.lean.runs(len(ids), x, context)  # an int8 cache
    # A prompt beside a decode: on the paged prefill kernel it runs lean; past its caps (SDPA), not.
    prefill, ids, _ = _step([0, 20], query_lens=[6, 1])
    with set_forward_context(prefill, _caches(model, 1), backend="cpu") as context:
        assert inner.lean.runs(len(ids), inner.embed_tokens(ids), context)
    prefill, ids, _ = _step([0, 20], query_lens=[6, 1], prefill_caps=PrefillCaps(fresh=1, chunk=1))
    assert prefill.prefills
    with set_forward_context(prefill, _caches(model, 1), backend="cpu") as context:
        assert not inner.lean.runs(len(ids), inner.embed_tokens(ids), context)


@torch.inference_mode()
def test_models_it_was_not_written_for_run_the_modules(model, monkeypatch):
    inner = model.model
    meta, ids, _ = _step(CONTEXTS)
    x = inner.embed_tokens(ids)
    with set_forward_context(meta, _caches(model, 2), backend="cpu") as context:
        monkeypatch.setenv(ENV_SWITCH, "0")
        assert not LeanDecode(inner).runs(len(ids), x, context)
        monkeypatch.setenv(ENV_SWITCH, "1")
        assert LeanDecode(inner).runs(len(ids), x, context)
        down = inner.layers[1].mlp.down_proj
        copy, down.int8 = down.int8, None
        try:
            assert not LeanDecode(inner).runs(len(ids), x, context)  # a layer without its int8 copy
        finally:
            down.int8 = copy
        norm = inner.layers[0].post_attention_layernorm
        monkeypatch.setattr(norm, "_cpu_fused", False)
        assert not LeanDecode(inner).runs(len(ids), x, context)  # the torch norms


@torch.inference_mode()
def test_packed_weights_off_the_integer_op_run_the_modules(packed_models, monkeypatch):
    """fp32 activations (``WEFT_QUANT_ACTIVATIONS=fp32``) run other kernels (a float GEMM from
    1,024 rows): not one call, so the modules."""
    from services.worker.layers import quantized_linear

    inner = packed_models["Q4_1"].model
    meta, ids, _ = _step(CONTEXTS)
    x = inner.embed_tokens(ids)
    with set_forward_context(meta, _caches(packed_models["Q4_1"], 3), backend="cpu") as context:
        assert LeanDecode(inner).runs(len(ids), x, context)
        monkeypatch.setenv("WEFT_QUANT_ACTIVATIONS", "fp32")
        monkeypatch.setattr(quantized_linear, "_KERNEL", quantized_linear._Kernel())
        assert not LeanDecode(inner).runs(len(ids), x, context)


GEMMA3 = models_dir() / "gemma-3-270m-q4_k_m.gguf"
GEMMA3_STEPS = {  # (tokens cached per sequence, new tokens per sequence)
    **STEPS,
    "past-the-window": ([600, 700], [1, 3]),  # the window layers read their last 512 keys only
}


@pytest.fixture(scope="module")
def gemma3():
    """Gemma 3 270M at the defaults (packed, fp32), its layers in two KV cache groups as the model
    runner sets them: the global layers group 0, the window layers group 1, the first layer of
    each checking the attention call's arguments."""
    assert GEMMA3.exists(), f"{GEMMA3} is missing: run `make model-gemma3` (make test does) first"
    with gguf_parsed_once():
        model = load_model(EngineArgs(model=str(GEMMA3), dtype="float32").create_engine_config().model)
    seen: set[int] = set()
    for layer in model.model.layers:
        attn = layer.self_attn.attn
        attn.kv_group = 1 if attn.sliding_window else 0
        attn.checks_decode_args = attn.kv_group not in seen
        seen.add(attn.kv_group)
    assert seen == {0, 1}
    return model


@pytest.mark.parametrize("step", list(GEMMA3_STEPS))
@torch.inference_mode()
def test_gemma3s_lean_steps_give_the_module_paths_bits(gemma3, step):
    contexts, query_lens = GEMMA3_STEPS[step]
    meta, ids, positions = _step(contexts, query_lens)
    tables = [t.block_table for t in (meta.paged_decodes, meta.paged_prefills) if t is not None]
    blocks = 1 + max(int(t.max()) for t in tables)
    inner, args = gemma3.model, gemma3.args
    shape = kv_cache_shape(blocks, BLOCK, args.num_kv_heads, args.head_dim)
    results = {}
    for path in ("modules", "lean"):
        generator = torch.Generator().manual_seed(0)
        caches = [torch.randn(shape, generator=generator) for _ in range(args.num_layers)]
        # Both groups on the same tables here: the layers read their own group's all the same.
        with set_forward_context(meta, caches, backend="cpu", group_metadata=(meta, meta)) as context:
            x = inner.embed_tokens(ids) * inner.embed_scale
            if path == "modules":
                for layer in inner.layers:
                    x = layer(positions, x)
            else:
                assert inner.lean.runs(len(ids), x, context)
                x = inner.lean.forward(x, positions, context)
            hidden = gemma3(
                ids, positions
            )  # the model's forward (lean here): normed, on caches written again
        results[path] = (x, caches, hidden)
    (x, caches, hidden), (lean_x, lean_caches, lean_hidden) = results["modules"], results["lean"]
    assert torch.equal(lean_x, x)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(lean_caches, caches))
    assert torch.equal(lean_hidden, inner.norm(x))


@torch.inference_mode()
def test_gemma3_off_its_kernels_runs_the_modules(gemma3, monkeypatch):
    from services.worker.models.lean_gemma3 import LeanGemma3

    inner = gemma3.model
    meta, ids, _ = _step(CONTEXTS)
    x = inner.embed_tokens(ids) * inner.embed_scale
    with set_forward_context(meta, _caches(gemma3, 4), backend="cpu", group_metadata=(meta, meta)) as context:
        assert LeanGemma3(inner).runs(len(ids), x, context)
        monkeypatch.setattr(inner.layers[3].pre_feedforward_layernorm, "_cpu_fused", False)
        assert not LeanGemma3(inner).runs(len(ids), x, context)  # a torch norm
        monkeypatch.undo()
        monkeypatch.setattr(inner.layers[2].self_attn.rotary, "_cpu_fused", False)
        assert not LeanGemma3(inner).runs(len(ids), x, context)  # the torch rotation
        monkeypatch.undo()
        monkeypatch.setattr(inner.layers[5].mlp.act, "_cpu_fused", False)
        assert not LeanGemma3(inner).runs(len(ids), x, context)  # the torch GeGLU
        monkeypatch.undo()
        monkeypatch.setenv(ENV_SWITCH, "0")
        assert not LeanGemma3(inner).runs(len(ids), x, context)
    # A window group whose step is not on the paged kernels alone (SDPA prefills): the modules.
    prefill, ids, _ = _step([0, 20], query_lens=[6, 1], prefill_caps=PrefillCaps(fresh=1, chunk=1))
    paged, _, _ = _step([0, 20], query_lens=[6, 1])
    x = inner.embed_tokens(ids) * inner.embed_scale
    with set_forward_context(
        paged, _caches(gemma3, 4), backend="cpu", group_metadata=(paged, prefill)
    ) as context:
        assert not LeanGemma3(inner).runs(len(ids), x, context)
