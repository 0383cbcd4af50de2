"""Build the model a ``ModelConfig`` names and fill its weights.

The architecture always comes from the Hugging Face ``config.json`` (for a
GGUF file, the one extracted beside it by ``services.model_files``); the
weights from the GGUF file or from the folder's ``*.safetensors``.

Weights stream in one tensor at a time and each layer keeps only its
tensor-parallel slice: safetensors tensors arrive as lazy slices, so a rank
reads just its part from the file; GGUF tensors are dequantized one at a
time (quantized blocks do not split along arbitrary columns) and sliced.
With ``quantization == "gguf"`` the formats that have a packed layout stay
packed instead (``services.worker.layers.quantized_linear``), and the
loader logs what they take per parameter.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from protocol import ModelConfig
from services.model_files import ModelFiles, resolve
from services.worker.dummy_weights import fill_dummy_weights
from services.worker.gguf_weights import GGUFCheckpoint
from services.worker.layers.kernel_device import building_for
from services.worker.layers.quantized_linear import finalize_quantized, quantized_report
from services.worker.models.registry import model_class

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

logger = logging.getLogger(__name__)


def model_files(config: ModelConfig) -> ModelFiles:
    """The weights ``config.model`` names, with the config from ``config.tokenizer`` when it has one."""
    files = resolve(config.model)
    tokenizer_dir = Path(config.tokenizer)
    if (tokenizer_dir / "config.json").exists():
        files = ModelFiles(weights=files.weights, hf_dir=tokenizer_dir, name=files.name)
    return files


def load_model(config: ModelConfig, device: torch.device | str = "cpu") -> nn.Module:
    """The model on ``device``, holding this process's tensor-parallel share."""
    files = model_files(config)
    hf_config = files.hf_config()
    checkpoint = GGUFCheckpoint(files.weights) if files.is_gguf and config.load_format != "dummy" else None
    cls = model_class(hf_config, checkpoint.architecture if checkpoint else None)
    args = cls.args_class.from_hf_config(hf_config)
    if config.load_format == "dummy":
        weights = None  # random weights below; no checkpoint is opened
    elif checkpoint is not None:
        # A GGUF file without an output head ties it to the embedding, whatever the config says.
        args = dataclasses.replace(args, tie_word_embeddings=not checkpoint.has_output_head)
        weights = checkpoint.iter_weights(
            args.num_heads, args.num_kv_heads, keep_quantized=config.quantization == "gguf"
        )
    else:
        weights = iter_safetensors(files.weights)
    with building_for(device), torch.device(device):
        model = cls(args, config.max_model_len, DTYPES[config.dtype])
    if weights is None:
        fill_dummy_weights(model, config.seed)
    else:
        model.load_weights(weights)
    if config.quantization == "gguf":
        finalize_quantized(model, config.dense_min_rows, dense_int8=config.dense_copy_dtype == "int8")
        logger.info("GGUF weights kept quantized: %s", quantized_report(model).describe())
    logger.info("Resident weights: %s", weight_bytes(model).describe())
    return model.eval()


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """What a loaded model's weights hold in memory, by kind, each tensor counted once."""

    packed: int  # GGUF weights kept in their packed layouts (a tied head shares its embedding's)
    dense: int  # float parameters: norms, biases, unpacked layers, dense copies
    int8_copies: int  # int8 copies beside dense ones (--dense-copy-dtype int8)

    @property
    def total(self) -> int:
        return self.packed + self.dense + self.int8_copies

    def describe(self) -> str:
        parts = (("packed", self.packed), ("dense", self.dense), ("int8 copies", self.int8_copies))
        kinds = ", ".join(f"{name} {size / 2**20:.1f}" for name, size in parts if size)
        return f"{self.total / 2**20:.1f} MiB ({kinds or 'none'})"


def weight_bytes(model: nn.Module) -> WeightBytes:
    """The loader's accounting of resident weight bytes (``model.parameters()`` counts a shared
    tensor once; ``quantized_report`` a shared packed weight once)."""
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    copies = {id(m.int8): m.int8.nbytes for m in model.modules() if getattr(m, "int8", None) is not None}
    return WeightBytes(quantized_report(model).total_bytes, dense, sum(copies.values()))


class LazySlice:
    """A safetensors tensor not read yet: ``narrow`` reads only the part asked for.

    Valid while the generator that yielded it has not moved on (the file is open).
    """

    def __init__(self, handle) -> None:
        self._handle = handle
        self.shape = tuple(handle.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._handle[tuple(index)]


def iter_safetensors(folder: Path) -> Iterator[tuple[str, LazySlice]]:
    from safetensors import safe_open

    paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(
            f"{folder} has no *.safetensors files (other weight formats are not supported)."
        )
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, LazySlice(f.get_slice(name))
