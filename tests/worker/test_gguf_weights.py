"""GGUF tensor naming, the Q/K row order llama.cpp's converter changes, and dequantization."""

from __future__ import annotations

import numpy as np
import pytest

from services.worker import gguf_weights
from services.worker.gguf_weights import _dequantize, _unpermute_rows, hf_name


def llama_cpp_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q and K rows: per head, (2 halves, D/2) -> (D/2, 2)."""
    return (
        rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


@pytest.mark.parametrize("num_heads", [1, 3, 9])
def test_unpermute_undoes_the_converter(num_heads):
    weights = np.random.default_rng(0).standard_normal((num_heads * 64, 40)).astype(np.float32)
    assert np.array_equal(_unpermute_rows(llama_cpp_permute(weights, num_heads), num_heads), weights)
    bias = np.arange(num_heads * 8, dtype=np.float32)
    assert np.array_equal(_unpermute_rows(llama_cpp_permute(bias, num_heads), num_heads), bias)


def test_names_map_to_hugging_face():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.12.attn_v.bias") == "model.layers.12.self_attn.v_proj.bias"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None


def test_unknown_tensors_are_refused():
    with pytest.raises(ValueError, match="Unknown GGUF tensor"):
        hf_name("blk.0.ffn_gate_exps.weight")
    with pytest.raises(ValueError, match="Unknown GGUF tensor"):
        hf_name("mm.projector.weight")


def test_gemma3_tensor_names():
    assert hf_name("blk.2.ffn_norm.weight", "gemma3") == "model.layers.2.pre_feedforward_layernorm.weight"
    layer = "model.layers.2"
    assert hf_name("blk.2.post_attention_norm.weight", "gemma3") == f"{layer}.post_attention_layernorm.weight"
    assert hf_name("blk.2.post_ffw_norm.weight", "gemma3") == f"{layer}.post_feedforward_layernorm.weight"
    assert hf_name("blk.0.attn_q_norm.weight", "gemma3") == "model.layers.0.self_attn.q_norm.weight"
    assert hf_name("blk.0.attn_k_norm.weight", "gemma3") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_name("output_norm.weight", "gemma3") == "model.norm.weight"
    with pytest.raises(ValueError, match="Unknown GGUF tensor"):
        hf_name("blk.0.attn_q_norm.weight")  # not a Llama tensor


def test_qwen3_per_head_norm_names():
    assert hf_name("blk.4.attn_q_norm.weight", "qwen3") == "model.layers.4.self_attn.q_norm.weight"
    assert hf_name("blk.4.attn_k_norm.weight", "qwen3") == "model.layers.4.self_attn.k_norm.weight"
    assert hf_name("blk.4.ffn_norm.weight", "qwen3") == "model.layers.4.post_attention_layernorm.weight"
    with pytest.raises(ValueError, match="Unknown GGUF tensor"):
        hf_name("blk.4.attn_q_norm.weight", "llama")  # Llama has no such norm


@pytest.mark.parametrize(
    "qtype", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "BF16", "F16", "F32"]
)
def test_dequantization_is_gguf_quants_bit_for_bit(monkeypatch, qtype):
    """Over slices of rows, the values of ``gguf.quants.dequantize`` (transformers' own), every bit:
    random bytes, so scales and values of every kind (NaNs too); a small slice, so several slices and
    a short last one."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    monkeypatch.setattr(gguf_weights, "_DEQUANTIZE_BLOCKS", 8)
    kind = GGMLQuantizationType[qtype]
    _, type_size = GGML_QUANT_SIZES[kind]
    data = np.random.default_rng(1).integers(0, 256, (37, 3 * type_size), dtype=np.uint8)
    if kind in (GGMLQuantizationType.F16, GGMLQuantizationType.F32):  # stored as their own dtype
        data = data.view(np.float16 if kind == GGMLQuantizationType.F16 else np.float32)
    with np.errstate(all="ignore"):  # random scales: infinities and NaNs
        want, got = dequantize(data, kind), _dequantize(data, kind)
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
