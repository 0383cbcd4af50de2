"""Our Llama-family model against Hugging Face transformers (the oracle)."""

from __future__ import annotations

import pytest
import torch

from services.worker.gguf_weights import GGUFCheckpoint
from services.worker.layers.linear import pack_linear_weights
from services.worker.model_loader import load_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]


@pytest.fixture(scope="module")
def hf_oracle(hf_default_model):
    return hf_default_model  # transformers on the same GGUF (smollm_config's), loaded once per session


@pytest.fixture(scope="module")
def tokenizer(smollm_config):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_config.model.tokenizer)


def test_gguf_weights_are_bit_identical_to_the_oracle(smollm_config, hf_oracle):
    checkpoint = GGUFCheckpoint(smollm_config.model.model)
    assert checkpoint.architecture == "llama" and not checkpoint.has_output_head
    ours = dict(checkpoint.iter_weights(num_heads=9, num_kv_heads=3))
    theirs = hf_oracle.state_dict()
    for name in [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.7.self_attn.k_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.layers.3.input_layernorm.weight",
        "model.norm.weight",
    ]:
        assert torch.equal(ours[name], theirs[name]), name
    assert "lm_head.weight" not in ours  # tied embeddings


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_the_oracle(prompt, smollm_runner, hf_oracle, tokenizer, run_dense):
    ids = tokenizer(prompt)["input_ids"]
    ours = run_dense(smollm_runner.model, ids)
    with torch.inference_mode():
        theirs = hf_oracle(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=1e-4)
    assert ours[-1].argmax() == theirs[-1].argmax()


@pytest.fixture
def compare_with_hf(make_engine_config, run_dense):
    return lambda folder, token_ids, packed=False: _compare_with_hf(
        folder, token_ids, make_engine_config, run_dense, packed
    )


def _compare_with_hf(folder, token_ids, make_engine_config, run_dense, packed):
    from transformers import AutoModelForCausalLM

    config = make_engine_config(str(folder), str(folder), max_model_len=256)
    model = load_model(config.model)
    if packed:  # the cpu backend's oneDNN-packed linear weights
        assert pack_linear_weights(model, torch.float32, torch.device("cpu"))
    ours = run_dense(model, token_ids)
    with torch.inference_mode():
        theirs = (
            AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            .eval()(torch.tensor([token_ids]))
            .logits[0]
        )
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


TOKENS = [3, 17, 42, 99, 5, 250, 128, 7, 7, 7, 64, 1]


def test_safetensors_llama_matches(tiny_llama_dir, compare_with_hf):
    compare_with_hf(tiny_llama_dir, TOKENS)


def test_qwen2_with_qkv_bias_and_untied_head(tmp_path, make_tiny_hf_model, compare_with_hf):
    folder = make_tiny_hf_model(tmp_path, "qwen2", tie_word_embeddings=False)
    compare_with_hf(folder, TOKENS)


@pytest.mark.parametrize("model_type,overrides", [("llama", {}), ("qwen2", {"tie_word_embeddings": False})])
def test_packed_weights_match(tmp_path, make_tiny_hf_model, compare_with_hf, model_type, overrides):
    """Tied and untied heads, biased and unbiased projections, through oneDNN's packed weights."""
    compare_with_hf(make_tiny_hf_model(tmp_path, model_type, **overrides), TOKENS, packed=True)


def test_llama3_rope_scaling(tmp_path, make_tiny_hf_model, compare_with_hf):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    folder = make_tiny_hf_model(tmp_path, "llama", rope_parameters=rope, attention_bias=True)
    compare_with_hf(folder, TOKENS * 3)


def test_unsupported_architecture_is_refused():
    from services.worker.models.registry import model_class

    with pytest.raises(ValueError, match="Unsupported model"):
        model_class({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    assert model_class({"model_type": "llama"}).__name__ == "LlamaForCausalLM"
