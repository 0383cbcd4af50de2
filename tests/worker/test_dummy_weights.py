"""``--load-format dummy``: a model of a config's shape with random weights, no checkpoint read."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from protocol import ModelConfig
from services.config.cli_args import add_engine_args, engine_args_from
from services.worker.forward_context import set_forward_context
from services.worker.layers.attention_metadata import build_attention_metadata
from services.worker.model_loader import load_model

TINY_CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def config_only_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))  # and no weights at all
    return tmp_path


def test_dummy_model_has_the_config_shape_and_runs(tmp_path):
    folder = str(config_only_folder(tmp_path))
    config = ModelConfig(
        model=folder,
        tokenizer=folder,
        served_model_name="x",
        dtype="float32",
        max_model_len=64,
        load_format="dummy",
    )
    model = load_model(config)
    assert model.args.num_layers == 2 and model.args.vocab_size == 256
    params = dict(model.named_parameters())
    assert torch.equal(params["model.norm.weight"], torch.ones(64))
    assert 0.01 < params["model.layers.0.mlp.down_proj.weight"].std().item() < 0.04
    meta = build_attention_metadata(
        query_lens=np.array([5]),
        context_lens=np.array([0]),
        block_table=np.zeros((1, 1), np.int32),
        slot_mapping=np.zeros(5),
        block_size=16,
    )
    with torch.inference_mode(), set_forward_context(meta, None):
        logits = model.compute_logits(model(torch.arange(5), torch.arange(5)))
    assert logits.shape == (5, 256) and torch.isfinite(logits).all()
    again = load_model(config)  # seeded: the same weights every time (every rank of a TP group alike)
    assert torch.equal(
        dict(again.named_parameters())["model.embed_tokens.weight"], params["model.embed_tokens.weight"]
    )


def test_flags_reach_the_config(tmp_path):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    folder = str(config_only_folder(tmp_path))
    args = engine_args_from(
        parser.parse_args(["--model", folder, "--load-format", "dummy", "--enforce-eager", "--device", "cpu"])
    )
    config = args.create_engine_config()
    assert config.model.load_format == "dummy" and config.device.enforce_eager
    defaults = engine_args_from(
        parser.parse_args(["--model", folder, "--device", "cpu"])
    ).create_engine_config()
    assert defaults.model.load_format == "auto" and not defaults.device.enforce_eager
    args.load_format = "safetensors"
    with pytest.raises(ValueError, match="load_format"):
        args.create_engine_config()
