"""Which model class serves a checkpoint, by the architecture it declares.

The architectures and how a checkpoint names one are ``services/config/architectures.py``'s
(the engine arguments check the model before any process starts); this maps each model
family to its class, imported only when one is built. Torch-free.
"""

from __future__ import annotations

import importlib

from services.config.architectures import ARCHITECTURES, architecture_of, layer_sliding_windows

__all__ = ["ARCHITECTURES", "architecture_of", "layer_sliding_windows", "model_class"]

# Model family (``ARCHITECTURES``' values) -> "module:class".
_FAMILY_CLASSES = {
    "llama": "services.worker.models.llama:LlamaForCausalLM",
    "gemma3": "services.worker.models.gemma3:Gemma3ForCausalLM",
}


def model_class(hf_config: dict, gguf_architecture: str | None = None) -> type:
    family = ARCHITECTURES[architecture_of(hf_config, gguf_architecture)]
    module_name, _, class_name = _FAMILY_CLASSES[family].partition(":")
    return getattr(importlib.import_module(module_name), class_name)
