"""Qwen3, Gemma 3 and Mistral-style sliding windows against transformers, on random tiny checkpoints."""

from __future__ import annotations

import msgspec
import pytest
import torch

from services.worker.model_loader import load_model
from services.worker.models.registry import (
    ARCHITECTURES,
    architecture_of,
    layer_sliding_windows,
    model_class,
)

TOKENS = [3, 17, 42, 99, 5, 250, 128, 7, 7, 7, 64, 1]
LONG = [(7 * i + 3) % 256 for i in range(40)]  # longer than the tiny windows below
# Two window layers, then a global one, twice; an 8-token window, local and global rotary bases apart.
GEMMA3 = {
    "num_hidden_layers": 6,
    "head_dim": 16,
    "sliding_window": 8,
    "query_pre_attn_scalar": 24,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
}


def logits_match(folder, token_ids, make_engine_config, run_dense, atol=1e-4):
    from transformers import AutoModelForCausalLM

    model_config = make_engine_config(str(folder), str(folder), max_model_len=256).model
    windows = layer_sliding_windows(_hf_config(folder))
    ours = run_dense(
        load_model(msgspec.structs.replace(model_config, layer_sliding_windows=windows)), token_ids
    )
    with torch.inference_mode():
        theirs = (
            AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            .eval()(torch.tensor([token_ids]))
            .logits[0]
        )
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=1e-4)


def _hf_config(folder) -> dict:
    import json

    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("tied", [True, False])
def test_qwen3_qk_norm_without_qkv_bias(tmp_path, make_tiny_hf_model, make_engine_config, run_dense, tied):
    folder = make_tiny_hf_model(tmp_path, "qwen3", head_dim=32, tie_word_embeddings=tied)
    assert model_class(_hf_config(folder)).__name__ == "LlamaForCausalLM"
    logits_match(folder, TOKENS, make_engine_config, run_dense)


@pytest.mark.parametrize("tied", [True, False])
def test_llama3_rope_scaling_tied_and_untied(
    tmp_path, make_tiny_hf_model, make_engine_config, run_dense, tied
):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    folder = make_tiny_hf_model(tmp_path, "llama", rope_parameters=rope, tie_word_embeddings=tied)
    logits_match(folder, TOKENS * 3, make_engine_config, run_dense)


@pytest.mark.parametrize("tied", [True, False])
def test_gemma3_window_and_global_layers(tmp_path, make_tiny_hf_model, make_engine_config, run_dense, tied):
    folder = make_tiny_hf_model(tmp_path, "gemma3_text", tie_word_embeddings=tied, **GEMMA3)
    assert layer_sliding_windows(_hf_config(folder)) == [8, 8, 0] * 2
    logits_match(folder, LONG, make_engine_config, run_dense)


def test_mistral_sliding_window(tmp_path, make_tiny_hf_model, make_engine_config, run_dense):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.MistralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
        max_position_embeddings=512,
    )
    tf.MistralForCausalLM(config).save_pretrained(tmp_path)
    assert layer_sliding_windows(_hf_config(tmp_path)) == [8, 8]
    logits_match(tmp_path, LONG, make_engine_config, run_dense)


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(
        ValueError, match="Unsupported model.*GPT2LMHeadModel.*Supported architectures: .*Gemma3ForCausalLM"
    ):
        architecture_of({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ValueError, match="architecture 'phi3'.*Qwen3ForCausalLM"):
        architecture_of({"model_type": "phi3"})  # a GGUF's config names only its model_type
    assert architecture_of({"model_type": "gemma3_text"}) == "Gemma3ForCausalLM"
    assert architecture_of({}, gguf_architecture="qwen3") == "Qwen3ForCausalLM"
    assert set(ARCHITECTURES) >= {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma3ForCausalLM",
    }


def test_an_unsupported_checkpoint_is_refused_before_anything_starts(tmp_path):
    from services.config.engine_args import EngineArgs

    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="Unsupported model.*Supported architectures: LlamaForCausalLM"):
        EngineArgs(model=str(tmp_path)).create_engine_config()


def test_the_cpu_profile_runs_one_layer_of_each_kind(tmp_path, make_tiny_hf_model, make_engine_config):
    """Sizing the KV cache profiles a step through the first window layer and the first global
    layer only (their peak is the step's), and leaves the model whole afterwards."""
    from services.worker.model_runner import ModelRunner, one_layer_per_kind

    folder = make_tiny_hf_model(tmp_path, "gemma3_text", **GEMMA3)
    config = make_engine_config(str(folder), str(folder), max_model_len=64)
    windows = layer_sliding_windows(_hf_config(folder))
    config = msgspec.structs.replace(
        config, model=msgspec.structs.replace(config.model, layer_sliding_windows=windows)
    )
    runner = ModelRunner(config, "cpu")
    runner.load_model()
    layers = runner.model.model.layers
    kinds = one_layer_per_kind(layers)
    assert [layer is layers[i] for i, layer in zip((0, 2), kinds, strict=True)] == [True, True]
    seen = []
    for layer in layers:
        layer.register_forward_hook(lambda module, args, out: seen.append(module))
    runner.profile_forward(16)
    assert seen == kinds
    assert runner.model.model.layers is layers
