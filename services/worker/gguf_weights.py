"""Read a GGUF checkpoint as fp32 tensors under Hugging Face names.

Dequantization is ``gguf.quants``' own block routine, the one transformers uses,
so our fp32 weights are bit-identical to the Hugging Face oracle's; it runs over
4096-block slices of a tensor rather than ``gguf.quants.dequantize``'s 16-row
groups, whose per-group Python cost was half of the 1.4 s of CPU a dequantized
SmolLM2 took to load (3.3 s → 2.2 s for Gemma 3 270M, whose Q8_0 embedding is
bound by memory).

llama.cpp's converter reorders the rows of Llama's Q and K projections
(per head, it interleaves the two rotary halves to suit its own rope
kernel); ``_unpermute_rows`` restores Hugging Face's order. Only files whose
architecture is "llama" (which includes Mistral) were permuted; Qwen2 was not.

With ``keep_quantized`` the matrices in a format that has a packed layout
(``services.worker.gguf_repack``) are yielded as ``PackedWeight`` instead,
repacked straight from their blocks; the rest are dequantized as above.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from services.worker.gguf_repack import packable, repack
from services.worker.layers.quantized_linear import PackedWeight

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
# Gemma 3's extra norms; its "ffn_norm" is the norm before the MLP, as in Llama, but Gemma
# calls that one pre_feedforward_layernorm (post_attention_layernorm follows attention).
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Qwen3: RMSNorm over each head of Q and K.
_QWEN3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LAYER_NAMES_BY_ARCHITECTURE = {"gemma3": _GEMMA3_LAYER_NAMES, "qwen3": _QWEN3_LAYER_NAMES}
# llama.cpp's converter stores Gemma's norm weights as 1 + w (its RMSNorm multiplies by the
# weight alone); Hugging Face's keep w, and so do ours.
_NORM_OFFSET_ARCHITECTURES = {"gemma3"}
# Tensors llama.cpp stores that the config already determines.
_SKIPPED = {"rope_freqs"}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_PERMUTED_ARCHITECTURES = {"llama"}


_DEQUANTIZE_BLOCKS = 1 << 12  # per slice: 512 KiB of fp32 from a 32-value format, in cache


def _dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """``gguf.quants.dequantize``'s values, from its per-format routine over slices of rows."""
    import gguf.quants
    from gguf.constants import GGML_QUANT_SIZES

    quant = getattr(gguf.quants, qtype.name, None)  # the format's class: Q4_1, Q6_K...
    if quant is None:  # F32, F16: a view or a cast
        return gguf.quants.dequantize(data, qtype)
    quant.init_grid()  # the IQ formats' lookup grids (a no-op for the rest)
    rows = data.reshape(-1, data.shape[-1])
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    # Written in place, a slice at a time: the load's peak stays one fp32 copy of the tensor (the
    # profiled KV budget is what the process holds after it).
    out = np.empty((rows.shape[0], rows.shape[1] // type_size * block_size), dtype=np.float32)
    per_slice = max(1, _DEQUANTIZE_BLOCKS * type_size // rows.shape[1])
    for i in range(0, len(rows), per_slice):
        out[i : i + per_slice] = quant.dequantize_rows(rows[i : i + per_slice])
    return out.reshape(*data.shape[:-1], out.shape[1])


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None to skip."""
    match = _LAYER_PATTERN.fullmatch(gguf_name)
    if match:
        layer, kind, suffix = match.groups()
        names = _LAYER_NAMES_BY_ARCHITECTURE.get(architecture, _LAYER_NAMES)
        if kind not in names:
            raise ValueError(f"Unknown GGUF tensor {gguf_name!r}.")
        return f"model.layers.{layer}.{names[kind]}.{suffix}"
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
    """One GGUF file, opened once; its metadata arrays (the tokenizer's) are skipped."""

    def __init__(self, path: Path | str) -> None:
        from services.worker.gguf_reader import TensorsReader

        self.path = Path(path)
        self._reader = TensorsReader(self.path)
        field = self._reader.fields["general.architecture"]
        self.architecture = bytes(field.parts[field.data[0]]).decode()

    @property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self._reader.tensors}

    @property
    def tensor_bytes(self) -> int:
        """Bytes of every tensor in the file, as stored (quantized blocks included)."""
        return sum(int(t.n_bytes) for t in self._reader.tensors)

    @property
    def has_output_head(self) -> bool:
        """False when the file ties the output head to the token embedding."""
        return "output.weight" in self.tensor_names

    def iter_weights(
        self, num_heads: int, num_kv_heads: int, keep_quantized: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        """Yield (Hugging Face name, fp32 tensor or, with ``keep_quantized``, ``PackedWeight``)
        for every tensor of the file."""
        permuted = self.architecture in _PERMUTED_ARCHITECTURES
        for tensor in self._reader.tensors:
            name = hf_name(tensor.name, self.architecture)
            if name is None:
                continue
            if keep_quantized and len(tensor.shape) == 2 and packable(tensor.tensor_type.name):
                order = None
                if permuted and (".q_proj." in name or ".k_proj." in name):
                    heads = num_heads if ".q_proj." in name else num_kv_heads
                    order = _unpermute_rows(np.arange(tensor.data.shape[0]), heads)
                yield name, repack(tensor.tensor_type.name, tensor.data, int(tensor.shape[0]), order)
                continue
            weights = _dequantize(tensor.data, tensor.tensor_type)
            if permuted and ".q_proj." in name:
                weights = _unpermute_rows(weights, num_heads)
            elif permuted and ".k_proj." in name:
                weights = _unpermute_rows(weights, num_kv_heads)
            weights = self._undo_norm_offset(name, weights)
            weights = np.ascontiguousarray(weights, dtype=np.float32)
            if not weights.flags.writeable:  # an unquantized tensor still mapped from the file
                weights = weights.copy()
            yield name, torch.from_numpy(weights)

    def _undo_norm_offset(self, name: str, weights: np.ndarray) -> np.ndarray:
        """Gemma: the file's norm weights are 1 + w; subtract in fp32, as transformers' loader does."""
        if self.architecture in _NORM_OFFSET_ARCHITECTURES and name.endswith("norm.weight"):
            return weights - 1
        return weights
