"""Gemma 3 (text) over a flattened batch.

What sets it apart from the Llama family (``llama.py``), all as Hugging
Face's ``Gemma3ForCausalLM`` computes it:

- the token embedding scaled by sqrt(hidden_size), the output head tied to it;
- RMSNorm scaling by ``1 + weight``, and four norms per layer: before and
  after attention, before and after the MLP (each sublayer's output is
  normalized before it joins the residual stream);
- Q and K normalized per head (QK-norm) before the rotation;
- a GeGLU MLP (gelu, tanh approximation);
- attention scaled by ``query_pre_attn_scalar ** -0.5``;
- two kinds of layer: sliding-window ("sliding_attention", the last
  ``sliding_window`` tokens, rotary base ``rope_local_base_freq``) and
  global ("full_attention", every earlier token, the global rotary base);
  ``layer_types`` says which is which (five window layers, then a global one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from services.config.gemma3_config import (
    FULL,
    SLIDING,
    gemma3_layer_types,
    gemma3_sliding_window,
)
from services.worker.distributed import TensorParallelGroup, get_tp_group
from services.worker.forward_context import get_forward_context
from services.worker.layers.activation import GeluTanhAndMul
from services.worker.layers.attention import GatherWorkspace, PagedAttention
from services.worker.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    even_slices,
    qkv_slices,
)
from services.worker.layers.norm import GemmaRMSNorm
from services.worker.layers.rotary import RotaryEmbedding
from services.worker.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from services.worker.models.lean_gemma3 import LeanGemma3
from services.worker.models.llama import LlamaForCausalLM, rank_args


@dataclass(frozen=True)
class Gemma3Args:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]
    sliding_window: int
    rope: dict[str, tuple[float, dict | None]]  # layer type -> (theta, scaling or None)
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    max_position_embeddings: int
    tie_word_embeddings: bool = True

    @classmethod
    def from_hf_config(cls, config: dict) -> Gemma3Args:
        if config.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(
                f"hidden_activation {config['hidden_activation']!r} is not supported for Gemma 3."
            )
        if config.get("attn_logit_softcapping") is not None:
            raise ValueError("attn_logit_softcapping (Gemma 2 style) is not supported.")
        if config.get("use_bidirectional_attention"):
            raise ValueError(
                "use_bidirectional_attention (an encoder setting) is not supported; weft generates causally."
            )
        layers = config["num_hidden_layers"]
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=layers,
            num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            head_dim=config.get("head_dim") or 256,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            layer_types=gemma3_layer_types(config, layers),
            sliding_window=gemma3_sliding_window(config),
            rope=_rope_by_layer_type(config),
            query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or 256),
            final_logit_softcapping=config.get("final_logit_softcapping"),
            max_position_embeddings=config.get("max_position_embeddings", 131072),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        )


def _rope_by_layer_type(config: dict) -> dict[str, tuple[float, dict | None]]:
    """transformers 5 keeps ``rope_parameters`` per layer type; older configs ``rope_theta``,
    ``rope_local_base_freq`` and one ``rope_scaling`` (for the global layers)."""
    params = config.get("rope_parameters")
    if params and FULL in params:
        return {kind: _rope(dict(params.get(kind) or {}), 10000.0) for kind in (SLIDING, FULL)}
    scaling = dict(config.get("rope_scaling") or {})
    return {
        SLIDING: (float(config.get("rope_local_base_freq", 10000.0)), None),
        FULL: _rope({"rope_theta": config.get("rope_theta", 1000000.0), **scaling}, 1000000.0),
    }


def _rope(params: dict, default_theta: float) -> tuple[float, dict | None]:
    theta = float(params.pop("rope_theta", default_theta))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    return theta, None if rope_type == "default" else {"rope_type": rope_type, **params}


class Gemma3Attention(nn.Module):
    def __init__(
        self,
        args: Gemma3Args,
        layer_idx: int,
        rotary: RotaryEmbedding,
        workspace: GatherWorkspace,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
        checkpoint_args: Gemma3Args,
    ) -> None:
        super().__init__()
        d = self.head_dim = args.head_dim
        self.q_size, self.kv_size = args.num_heads * d, args.num_kv_heads * d
        c = checkpoint_args
        self.qkv_proj = ColumnParallelLinear(
            args.hidden_size, qkv_slices(c.num_heads, c.num_kv_heads, d, tp), False, dtype
        )
        self.o_proj = RowParallelLinear(c.num_heads * d, args.hidden_size, False, dtype, tp)
        self.q_norm = GemmaRMSNorm(d, args.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(d, args.rms_norm_eps, dtype)
        self.rotary = rotary
        window = args.sliding_window if args.layer_types[layer_idx] == SLIDING else None
        self.attn = PagedAttention(
            layer_idx,
            args.num_heads,
            args.num_kv_heads,
            d,
            workspace,
            sliding_window=window,
            scale=args.query_pre_attn_scalar**-0.5,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """positions [T], x [T, hidden] -> [T, hidden]."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, -1, self.head_dim)).reshape(t, -1)  # per head, before the rotation
        k = self.k_norm(k.reshape(t, -1, self.head_dim)).reshape(t, -1)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous()))


class Gemma3MLP(nn.Module):
    def __init__(self, args: Gemma3Args, dtype: torch.dtype, tp: TensorParallelGroup) -> None:
        super().__init__()
        size = args.intermediate_size
        slices = even_slices([size, size], tp, ["intermediate_size"] * 2)
        self.gate_up_proj = ColumnParallelLinear(args.hidden_size, slices, False, dtype)
        self.down_proj = RowParallelLinear(size, args.hidden_size, False, dtype, tp, "intermediate_size")
        self.act = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        args: Gemma3Args,
        layer_idx: int,
        rotary: RotaryEmbedding,
        workspace: GatherWorkspace,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
        checkpoint_args: Gemma3Args,
    ) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(args, layer_idx, rotary, workspace, dtype, tp, checkpoint_args)
        self.mlp = Gemma3MLP(args, dtype, tp)
        size, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(
        self,
        args: Gemma3Args,
        max_model_len: int,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
        checkpoint_args: Gemma3Args,
    ) -> None:
        super().__init__()
        rotaries = {
            kind: RotaryEmbedding(args.head_dim, max_model_len, theta, scaling)
            for kind, (theta, scaling) in args.rope.items()
        }
        self.workspace = GatherWorkspace()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, dtype, tp)
        # Hugging Face rounds the scale to the weights' dtype before multiplying.
        self.register_buffer(
            "embed_scale", torch.tensor(math.sqrt(args.hidden_size), dtype=dtype), persistent=False
        )
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(
                args, i, rotaries[args.layer_types[i]], self.workspace, dtype, tp, checkpoint_args
            )
            for i in range(args.num_layers)
        )
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.lean = LeanGemma3(self)  # decode-only steps as their kernels called straight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale
        context = get_forward_context()
        if self.lean.runs(x.shape[0], x, context):
            x = self.lean.forward(x, positions, context)
        else:
            for layer in self.layers:
                x = layer(positions, x)
        return self.norm(x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Loads weights as the Llama class does (same fused Q/K/V and gate/up); only the modules differ."""

    args_class = Gemma3Args

    def __init__(
        self,
        args: Gemma3Args,
        max_model_len: int,
        dtype: torch.dtype = torch.float32,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        nn.Module.__init__(self)
        tp = tp or get_tp_group()
        self.checkpoint_args = args
        self.args = rank_args(args, tp)
        self.model = Gemma3Model(self.args, max_model_len, dtype, tp, args)
        tied = self.model.embed_tokens if args.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, dtype, tp, tied_to=tied)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head.compute_logits(hidden)
        cap = self.args.final_logit_softcapping
        if logits is not None and cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
