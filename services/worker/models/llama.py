"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flattened batch.

The model sees one "super-sequence" per step: ``input_ids [T]`` and
``positions [T]`` of all scheduled requests back to back. Where a token's
keys and values go, and which ones it may attend to, comes from the
forward context (``services.worker.forward_context``).

Q, K and V share one projection and gate/up share another (fewer, larger
matmuls); ``load_weights`` takes checkpoint tensors under their Hugging
Face names and fills the fused weights shard by shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from services.worker.layers.attention import GatherWorkspace, PagedAttention
from services.worker.layers.linear import Embedding, Linear
from services.worker.layers.norm import RMSNorm
from services.worker.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None

    @classmethod
    def from_hf_config(cls, config: dict) -> LlamaArgs:
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported; the Llama family uses 'silu'.")
        heads = config["num_attention_heads"]
        is_qwen2 = config.get("model_type") == "qwen2"
        attention_bias = bool(config.get("attention_bias", False))
        theta, scaling = _rope_settings(config)
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,  # Qwen2 always biases Q, K and V, never O
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(config.get("mlp_bias", False)),
            sliding_window=_sliding_window(config),
        )


def _rope_settings(config: dict) -> tuple[float, dict | None]:
    """(theta, scaling or None) from transformers 5's ``rope_parameters`` or the older keys."""
    params = dict(config.get("rope_parameters") or {})
    params.update(config.get("rope_scaling") or {})
    theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    return float(theta), None if rope_type == "default" else {"rope_type": rope_type, **params}


def _sliding_window(config: dict) -> int | None:
    if config.get("model_type") == "qwen2" and not config.get("use_sliding_window", False):
        return None
    return config.get("sliding_window")


class LlamaAttention(nn.Module):
    def __init__(
        self, args: LlamaArgs, layer_idx: int, rotary: RotaryEmbedding, workspace: GatherWorkspace, dtype: torch.dtype
    ) -> None:
        super().__init__()
        d = args.head_dim
        self.q_size, self.kv_size = args.num_heads * d, args.num_kv_heads * d
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, args.qkv_bias, dtype)
        self.o_proj = Linear(self.q_size, args.hidden_size, args.o_bias, dtype)
        self.rotary = rotary
        self.attn = PagedAttention(layer_idx, args.num_heads, args.num_kv_heads, d, workspace)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """positions [T], x [T, hidden] -> [T, hidden]."""
        qkv = self.qkv_proj(x)  # [T, (H + 2 * KVH) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, args.mlp_bias, dtype)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, args.mlp_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, args: LlamaArgs, layer_idx: int, rotary: RotaryEmbedding, workspace: GatherWorkspace, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args, layer_idx, rotary, workspace, dtype)
        self.mlp = LlamaMLP(args, dtype)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs, max_model_len: int, dtype: torch.dtype) -> None:
        super().__init__()
        # Shared by all layers: one rotation table, one decode gather buffer.
        rotary = RotaryEmbedding(args.head_dim, max_model_len, args.rope_theta, args.rope_scaling)
        self.workspace = GatherWorkspace()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(args, i, rotary, self.workspace, dtype) for i in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


# (fused parameter suffix, checkpoint suffix, shard index) for fused weights.
_FUSED = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: LlamaArgs, max_model_len: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if args.sliding_window is not None and max_model_len > args.sliding_window:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's sliding window ({args.sliding_window}), "
                "which is not implemented; lower max_model_len to at most the window."
            )
        self.args = args
        self.model = LlamaModel(args, max_model_len, dtype)
        self.lm_head = None if args.tie_word_embeddings else Linear(args.hidden_size, args.vocab_size, False, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T], positions [T] -> hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    @property
    def attention_workspace(self) -> GatherWorkspace:
        return self.model.workspace

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] (fp32)."""
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(hidden, head).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) in; every parameter must be filled."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue  # derived from the config, or tied to the embedding
            target, shard = self._target(name)
            if target not in params:
                raise ValueError(f"Checkpoint tensor {name!r} has no place in {type(self).__name__}.")
            self._copy_shard(target, params[target], tensor, shard)
            filled.add(target if shard is None else f"{target}#{shard}")
        missing = [n for n in self._expected_fills(params) if n not in filled]
        if missing:
            raise ValueError(f"Checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}.")

    def _target(self, name: str) -> tuple[str, int | None]:
        for fused, part, shard in _FUSED:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard
        return name, None

    def _copy_shard(self, name: str, param: torch.Tensor, tensor: torch.Tensor, shard: int | None) -> None:
        dest = param
        if shard is not None:
            sizes = self._shard_sizes(name)
            dest = param.narrow(0, sum(sizes[:shard]), sizes[shard])
        if dest.shape != tensor.shape:
            raise ValueError(f"Checkpoint tensor of shape {tuple(tensor.shape)} does not fit {name} {tuple(dest.shape)}.")
        dest.copy_(tensor)

    def _shard_sizes(self, fused_name: str) -> list[int]:
        a = self.args
        if ".qkv_proj." in fused_name:
            return [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
        return [a.intermediate_size, a.intermediate_size]

    def _expected_fills(self, params: dict[str, torch.Tensor]) -> list[str]:
        names = []
        for name in params:
            fused = [shard for f, _, shard in _FUSED if f".{f}." in name]
            names += [f"{name}#{s}" for s in fused] if fused else [name]
        return names
