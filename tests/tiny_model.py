"""A tiny random Llama with the real tokenizer, for tests that start engine processes.

Loads in well under a second, so a test can afford a few engine processes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from protocol import EngineConfig
from services import model_files
from services.config.engine_args import EngineArgs

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def build_tiny_llama(path: Path) -> Path:
    """Save a random 2-layer Llama (SmolLM2's vocabulary) plus tokenizer files to ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer_dir = model_files.resolve(None).hf_dir
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


def tiny_engine_config(model_dir: Path, num_blocks: int = 64) -> EngineConfig:
    """fp32 on CPU, one torch thread, exactly ``num_blocks`` KV blocks of 16 tokens (no profiling)."""
    return EngineArgs(
        model=str(model_dir),
        num_gpu_blocks_override=num_blocks,
        block_size=16,
        max_model_len=512,
        dtype="float32",
        device="cpu",
        num_threads=1,
    ).create_engine_config()
