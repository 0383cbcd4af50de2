"""The Llama family (Llama 2/3, Mistral, Qwen2/3, SmolLM2) over a flattened batch.

The model sees one "super-sequence" per step: ``input_ids [T]`` and
``positions [T]`` of all scheduled requests back to back. Where a token's
keys and values go, and which ones it may attend to, comes from the
forward context (``services.worker.forward_context``).

Q, K and V share one projection and gate/up share another (fewer, larger
matmuls); ``load_weights`` takes checkpoint tensors under their Hugging
Face names and fills the fused weights part by part.

Under tensor parallelism (``tp``) every rank builds the same model with its
share of each layer: its query heads and the KV heads they read, its slice
of the MLP, its rows of the vocabulary. Each layer cuts its slice out of a
checkpoint tensor as it loads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from kernels import cpu_fused
from services.worker.distributed import TensorParallelGroup, divide, get_tp_group
from services.worker.forward_context import get_forward_context
from services.worker.layers.activation import SiluAndMul
from services.worker.layers.attention import GatherWorkspace, PagedAttention
from services.worker.layers.kernel_device import cpu_fused_for_model
from services.worker.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_weight,
    even_slices,
    kv_heads_of_rank,
    qkv_slices,
    whole,
)
from services.worker.layers.norm import RMSNorm
from services.worker.layers.rotary import RotaryEmbedding
from services.worker.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from services.worker.models.lean_decode import LeanDecode


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
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of Q and K before the rotation

    @classmethod
    def from_hf_config(cls, config: dict) -> LlamaArgs:
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"hidden_act {config['hidden_act']!r} is not supported; the Llama family uses 'silu'."
            )
        heads = config["num_attention_heads"]
        is_qwen2 = config.get("model_type") == "qwen2"
        is_qwen3 = config.get("model_type") == "qwen3"
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
            qk_norm=is_qwen3,
        )


def _rope_settings(config: dict) -> tuple[float, dict | None]:
    """(theta, scaling or None) from transformers 5's ``rope_parameters`` or the older keys."""
    params = dict(config.get("rope_parameters") or {})
    params.update(config.get("rope_scaling") or {})
    theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    return float(theta), None if rope_type == "default" else {"rope_type": rope_type, **params}


def _sliding_window(config: dict) -> int | None:
    if config.get("model_type") in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
        return None
    return config.get("sliding_window")


class LlamaAttention(nn.Module):
    """``args`` counts this rank's heads (see ``LlamaForCausalLM.args``)."""

    def __init__(
        self,
        args: LlamaArgs,
        layer_idx: int,
        rotary: RotaryEmbedding,
        workspace: GatherWorkspace,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
        checkpoint_args: LlamaArgs,
    ) -> None:
        super().__init__()
        d = args.head_dim
        self.q_size, self.kv_size = args.num_heads * d, args.num_kv_heads * d
        c = checkpoint_args
        self.qkv_proj = ColumnParallelLinear(
            args.hidden_size, qkv_slices(c.num_heads, c.num_kv_heads, d, tp), args.qkv_bias, dtype
        )
        self.o_proj = RowParallelLinear(c.num_heads * d, args.hidden_size, args.o_bias, dtype, tp)
        self.rotary = rotary
        self.head_dim = d
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, args.rms_norm_eps, dtype)
        self.attn = PagedAttention(
            layer_idx, args.num_heads, args.num_kv_heads, d, workspace, sliding_window=args.sliding_window
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """positions [T], x [T, hidden] -> [T, hidden]."""
        qkv = self.qkv_proj(x)  # [T, (H + 2 * KVH) * D], this rank's heads
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if hasattr(self, "q_norm"):
            t = x.shape[0]
            q = self.q_norm(q.reshape(t, -1, self.head_dim)).reshape(t, -1)
            k = self.k_norm(k.reshape(t, -1, self.head_dim)).reshape(t, -1)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs, dtype: torch.dtype, tp: TensorParallelGroup) -> None:
        super().__init__()
        size = args.intermediate_size
        slices = even_slices([size, size], tp, ["intermediate_size"] * 2)
        self.intermediate_size = slices[0].size  # this rank's share
        self.gate_up_proj = ColumnParallelLinear(args.hidden_size, slices, args.mlp_bias, dtype)
        self.down_proj = RowParallelLinear(
            size, args.hidden_size, args.mlp_bias, dtype, tp, "intermediate_size"
        )
        self.act_fn = SiluAndMul()
        # The one-pass path between the int8 GEMMs: one worker, no gate/up bias, the kernels built.
        self._fused_int8 = tp.world_size == 1 and not args.mlp_bias and cpu_fused_for_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        gate_up = self.gate_up_proj.int8_copy_for(rows) if self._fused_int8 else None
        down = self.down_proj.int8_copy_for(rows) if gate_up is not None else None
        if (
            down is not None
            and x.dtype in cpu_fused.DTYPES
            and not (gate_up.one_call and x.dtype == torch.float32)
        ):
            # Both on their int8 copies: from the first GEMM's int32 result to the second's
            # int8 input in one pass (the same numbers as the three passes it replaces).
            acc, row_scale = gate_up.rounded_product(x)
            q, scale = cpu_fused.scale_silu_quantize_int8(
                acc, row_scale, gate_up.scale, down.hadamard_block, x.dtype
            )
            return down.linear_rounded(q, scale, self.down_proj.bias, x.dtype)
        # (Where each int8 linear is one call, the three calls below beat the pass's four.)
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] (this rank's share)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        args: LlamaArgs,
        layer_idx: int,
        rotary: RotaryEmbedding,
        workspace: GatherWorkspace,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
        checkpoint_args: LlamaArgs,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args, layer_idx, rotary, workspace, dtype, tp, checkpoint_args)
        self.mlp = LlamaMLP(args, dtype, tp)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is ``x + residual`` (``residual`` None: ``x`` alone, the first
        layer). Returns this layer's MLP output and the stream before it, unsummed: the next
        norm adds them in its fused kernel (as vLLM's layers do), one pass fewer a layer."""
        if residual is None:
            residual, normed = x, self.input_layernorm(x)
        else:
            normed, residual = self.input_layernorm(x, residual=residual)
        attn = self.self_attn(positions, normed)
        normed, residual = self.post_attention_layernorm(attn, residual=residual)  # residual += attn
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        args: LlamaArgs,
        max_model_len: int,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
        checkpoint_args: LlamaArgs,
    ) -> None:
        super().__init__()
        # Shared by all layers: one rotation table, one decode gather buffer.
        rotary = RotaryEmbedding(args.head_dim, max_model_len, args.rope_theta, args.rope_scaling)
        self.workspace = GatherWorkspace()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(args, i, rotary, self.workspace, dtype, tp, checkpoint_args)
            for i in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.lean = LeanDecode(self)  # decode-only steps as their kernels called straight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        context = get_forward_context()
        if self.lean.runs(x.shape[0], x, context):
            x, residual = self.lean.forward(x, positions, context)
        else:
            for layer in self.layers:
                x, residual = layer(positions, x, residual)
        return self.norm(x) if residual is None else self.norm(x, residual=residual)[0]


# (fused parameter suffix, checkpoint suffix, shard index) for fused weights.
_FUSED = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class LlamaForCausalLM(nn.Module):
    args_class = LlamaArgs  # what ``from_hf_config`` builds this class's arguments

    def __init__(
        self,
        args: LlamaArgs,
        max_model_len: int,
        dtype: torch.dtype = torch.float32,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        tp = tp or get_tp_group()
        self.checkpoint_args = args
        # What this rank holds: its share of the heads (the KV cache is sized
        # from these). Everything else is the checkpoint's.
        self.args = rank_args(args, tp)
        self.model = LlamaModel(self.args, max_model_len, dtype, tp, args)
        tied = self.model.embed_tokens if args.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, dtype, tp, tied_to=tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T], positions [T] -> hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    @property
    def attention_workspace(self) -> GatherWorkspace:
        return self.model.workspace

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] -> logits [N, vocab] (fp32) on the driver rank; None on the
        other tensor-parallel ranks, which must still call it (a collective)."""
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) in; every parameter must be filled.

        A weight may be a tensor or a lazy slice (``shape`` + ``narrow``):
        each layer reads only the part this rank keeps.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        filled: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (
                name == "lm_head.weight" and self.checkpoint_args.tie_word_embeddings
            ):
                continue  # derived from the config, or tied to the embedding
            target, shard = self._target(name)
            if target not in params:
                raise ValueError(f"Checkpoint tensor {name!r} has no place in {type(self).__name__}.")
            module_name, _, param_name = target.rpartition(".")
            module = modules[module_name]
            if hasattr(module, "load_weight"):
                module.load_weight(param_name, tensor, shard)
            else:  # replicated (norms): every rank keeps all of it
                copy_weight(params[target], whole(tensor), target)
            filled.add(target if shard is None else f"{target}#{shard}")
        missing = [n for n in self._expected_fills(params) if n not in filled]
        if missing:
            raise ValueError(f"Checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}.")

    def _target(self, name: str) -> tuple[str, int | None]:
        for fused, part, shard in _FUSED:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard
        return name, None

    def _expected_fills(self, params: dict[str, torch.Tensor]) -> list[str]:
        names = []
        for name in params:
            fused = [shard for f, _, shard in _FUSED if f".{f}." in name]
            names += [f"{name}#{s}" for s in fused] if fused else [name]
        return names


def rank_args(args: LlamaArgs, tp: TensorParallelGroup) -> LlamaArgs:
    """``args`` with this rank's head counts; a ValueError if the heads do not split over the ranks."""
    if tp.world_size == 1:
        return args
    num_heads = divide(args.num_heads, tp.world_size, "num_attention_heads")
    num_kv_heads, _ = kv_heads_of_rank(args.num_kv_heads, tp)
    divide(args.intermediate_size, tp.world_size, "intermediate_size")
    return dataclasses.replace(args, num_heads=num_heads, num_kv_heads=num_kv_heads)
