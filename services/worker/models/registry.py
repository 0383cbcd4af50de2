"""Which model class serves a Hugging Face config."""
from __future__ import annotations

from torch import nn

from services.worker.models.llama import LlamaForCausalLM

# Hugging Face `architectures` entries and `model_type`s we implement.
_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
_MODEL_TYPES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
}


def model_class(hf_config: dict) -> type[nn.Module]:
    """By ``architectures`` when the config names them, else by ``model_type``
    (configs extracted from GGUF files carry only the latter)."""
    architectures = hf_config.get("architectures") or []
    model_type = hf_config.get("model_type")
    for arch in architectures:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    if not architectures and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(
        f"Unsupported model: architectures={hf_config.get('architectures')}, model_type={model_type!r}. "
        f"Supported architectures: {', '.join(_ARCHITECTURES)}."
    )
