"""The model architectures weft serves, and what the engine arguments read from a checkpoint's config.

Hugging Face folders name their architecture in ``config.json``'s ``architectures``;
GGUF files in ``general.architecture`` (the config written beside a GGUF by
``services.model_files`` carries only a ``model_type``, so that is the fallback). Each
architecture maps to the family of model classes that serves it; the worker's
``services/worker/models/registry.py`` maps a family to its class. Torch-free: the
engine arguments refuse an unsupported model before any process starts.
"""

from __future__ import annotations

from services.config.gemma3_config import SLIDING, gemma3_layer_types, gemma3_sliding_window

# Hugging Face ``architectures`` entries -> the model family that serves them.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Gemma3ForCausalLM": "gemma3",
}
# ``model_type`` (and GGUF ``general.architecture``) -> the architecture it stands for.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def architecture_of(hf_config: dict, gguf_architecture: str | None = None) -> str:
    """The supported architecture the checkpoint declares, or a ValueError naming the supported ones."""
    declared = list(hf_config.get("architectures") or [])
    for arch in declared:
        if arch in ARCHITECTURES:
            return arch
    model_type = gguf_architecture or hf_config.get("model_type")
    if not declared and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    what = f"architectures={declared}" if declared else f"architecture {model_type!r}"
    raise ValueError(f"Unsupported model: {what}. Supported architectures: {', '.join(ARCHITECTURES)}.")


def layer_sliding_windows(hf_config: dict) -> list[int]:
    """Per layer, the sliding window it attends over (0: full attention); empty when all are full.

    The model classes decide the same from the same config; the worker checks that they agree.
    """
    layers = hf_config.get("num_hidden_layers") or 0
    window = hf_config.get("sliding_window") or 0
    model_type = hf_config.get("model_type")
    if model_type in ("gemma3", "gemma3_text"):
        window = gemma3_sliding_window(hf_config)
        return [window if kind == SLIDING else 0 for kind in gemma3_layer_types(hf_config, layers)]
    if model_type in ("qwen2", "qwen3") and not hf_config.get("use_sliding_window", False):
        return []
    return [window] * layers if window else []
