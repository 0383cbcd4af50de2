"""Rotary position embedding with a precomputed cos/sin table.

Supports the original RoPE ("default"), "linear" and "llama3" frequency
scaling. The table is built with the same fp32 operations Hugging Face
runs per forward, so positions rotate identically.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels import cpu_fused
from services.worker.forward_context import current_backend
from services.worker.layers.kernel_device import cpu_fused_for_model

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim / 2] fp32 rotation speeds, slowest last."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    raise ValueError(
        f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
    )


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: slow frequencies divided by ``factor``, fast ones kept, a smooth ramp between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    ramp = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, ramp, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = inverse_frequencies(head_dim, base, scaling)
        freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]  # [P, D/2]
        # [P, D], both halves the same angles: cos and sin taken once per angle and repeated, the values
        # HF's cos/sin of the concatenated angles give (a long context's table is millions of them).
        cos, sin = freqs.cos(), freqs.sin()
        # Not persistent: derived from the config, never read from a checkpoint.
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((sin, sin), dim=-1), persistent=False)
        self._cpu_fused = cpu_fused_for_model()  # chosen once: one compiled pass on CPU

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; query [T, H * D], key [T, KVH * D] -> rotated, same shapes.

        The Triton backend and the compiled CPU kernel rotate query and key in
        place and return them.
        """
        if current_backend() == "triton":
            from kernels.rotary import rotary_embedding

            rotary_embedding(positions, query, key, self.cos, self.sin, self.head_dim)
            return query, key
        if self._cpu_fused and query.device.type == "cpu" and query.dtype in cpu_fused.DTYPES:
            # Unchecked from Python: the model built these itself; the kernel still bounds-checks.
            cpu_fused.rotary_embedding(positions, query, key, self.cos, self.sin, self.head_dim, check=False)
            return query, key
        num_tokens = positions.shape[0]
        cos = self.cos[positions].to(query.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin[positions].to(query.dtype)[:, None, :]
        q = query.view(num_tokens, -1, self.head_dim)  # [T, H, D]
        k = key.view(num_tokens, -1, self.head_dim)  # [T, KVH, D]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q.reshape(num_tokens, -1), k.reshape(num_tokens, -1)
