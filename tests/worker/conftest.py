"""Shared worker fixtures: the real default model, and tiny random Hugging Face models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from protocol import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from services.model_files import resolve
from services.worker.forward_context import set_forward_context
from services.worker.layers.attention_metadata import build_attention_metadata


def engine_config(
    model: str,
    tokenizer: str,
    *,
    max_model_len=2048,
    num_blocks=None,
    kv_cache_memory=None,
    max_num_batched_tokens=2048,
    seed=0,
) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            model=model,
            tokenizer=tokenizer,
            served_model_name="x",
            dtype="float32",
            max_model_len=max_model_len,
            vocab_size=49152,
            eos_token_id=2,
            seed=seed,
        ),
        cache=CacheConfig(num_gpu_blocks_override=num_blocks, kv_cache_memory=kv_cache_memory),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=128),
        device=DeviceConfig(num_threads=1),
    )


@pytest.fixture(scope="session")
def smollm_config() -> EngineConfig:
    files = resolve(None)
    return engine_config(str(files.weights), str(files.hf_dir), num_blocks=1500)


@pytest.fixture(scope="session")
def smollm_runner(smollm_config):
    """The real default model in a ModelRunner with a KV cache (loaded once per session)."""
    from services.worker.model_runner import ModelRunner

    torch.set_num_threads(1)
    runner = ModelRunner(smollm_config)
    runner.load_model()
    runner.initialize_kv_cache(smollm_config.cache.num_gpu_blocks_override)
    return runner


def dense_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Our model's logits [T, V] for one sequence, prefilled at once without a cache."""
    n = len(token_ids)
    meta = build_attention_metadata(
        query_lens=np.array([n]),
        context_lens=np.array([0]),
        block_table=np.zeros((1, 1), np.int32),
        slot_mapping=np.zeros(n),
        block_size=16,
    )
    with torch.inference_mode(), set_forward_context(meta, None):
        return model.compute_logits(model(torch.tensor(token_ids), torch.arange(n)))


TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
)


def save_tiny_hf_model(path: Path, model_type: str = "llama", **overrides) -> Path:
    """A random Hugging Face model saved as config.json + safetensors; returns its folder."""
    import transformers as tf

    config_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
    }[model_type]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # Hugging Face starts biases at 0 and norms at 1: make them count
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_hf_model(tmp_path_factory.mktemp("tiny-llama"))


# Helpers handed to tests as fixtures (test modules never import conftest).
@pytest.fixture(scope="session")
def make_engine_config():
    return engine_config


@pytest.fixture(scope="session")
def run_dense():
    return dense_logits


@pytest.fixture(scope="session")
def make_tiny_hf_model():
    return save_tiny_hf_model
