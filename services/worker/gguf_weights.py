"""Read a GGUF checkpoint as fp32 tensors under Hugging Face names.

Dequantization is ``gguf.quants.dequantize``, the routine transformers uses,
so our fp32 weights are bit-identical to the Hugging Face oracle's.

llama.cpp's converter reorders the rows of Llama's Q and K projections
(per head, it interleaves the two rotary halves to suit its own rope
kernel); ``_unpermute_rows`` restores Hugging Face's order. Only files whose
architecture is "llama" (which includes Mistral) were permuted; Qwen2 was not.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp stores that the config already determines.
_SKIPPED = {"rope_freqs"}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_PERMUTED_ARCHITECTURES = {"llama"}


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None to skip."""
    match = _LAYER_PATTERN.fullmatch(gguf_name)
    if match:
        layer, kind, suffix = match.groups()
        if kind not in _LAYER_NAMES:
            raise ValueError(f"Unknown GGUF tensor {gguf_name!r}.")
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    base, _, suffix = gguf_name.rpartition(".")
    if base in _SKIPPED:
        return None
    if base not in _GLOBAL_NAMES:
        raise ValueError(f"Unknown GGUF tensor {gguf_name!r}.")
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def _unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Per head, llama.cpp stores rows as (D/2 pairs, 2); Hugging Face as (2 halves, D/2)."""
    half = rows.shape[0] // num_heads // 2
    grouped = rows.reshape(num_heads, half, 2, *rows.shape[1:])
    return grouped.swapaxes(1, 2).reshape(rows.shape)


class GGUFCheckpoint:
    """One GGUF file, opened once (parsing its metadata takes seconds)."""

    def __init__(self, path: Path | str) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        self._reader = GGUFReader(self.path)
        field = self._reader.fields["general.architecture"]
        self.architecture = bytes(field.parts[field.data[0]]).decode()

    @property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self._reader.tensors}

    @property
    def has_output_head(self) -> bool:
        """False when the file ties the output head to the token embedding."""
        return "output.weight" in self.tensor_names

    def iter_weights(self, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (Hugging Face name, fp32 tensor) for every tensor of the file."""
        from gguf.quants import dequantize

        permuted = self.architecture in _PERMUTED_ARCHITECTURES
        for tensor in self._reader.tensors:
            name = hf_name(tensor.name)
            if name is None:
                continue
            weights = dequantize(tensor.data, tensor.tensor_type)
            if permuted and ".q_proj." in name:
                weights = _unpermute_rows(weights, num_heads)
            elif permuted and ".k_proj." in name:
                weights = _unpermute_rows(weights, num_kv_heads)
            weights = np.ascontiguousarray(weights, dtype=np.float32)
            if not weights.flags.writeable:  # an unquantized tensor still mapped from the file
                weights = weights.copy()
            yield name, torch.from_numpy(weights)
