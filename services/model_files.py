"""Where the model's files are, and the one-time preparation of a GGUF.

A GGUF file carries the tokenizer and the config in its metadata, but
building a Hugging Face tokenizer from it takes seconds. ``prepare`` does
that once, writing ``tokenizer.json``, ``config.json`` and friends to a
folder beside the GGUF (``<name>.hf/``); every process then loads them from
there. Nothing here downloads anything.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from services import env

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def models_dir() -> Path:
    return Path(env.get("WEFT_MODELS_DIR") or REPO_ROOT / "models")


@dataclass(frozen=True)
class ModelFiles:
    weights: Path  # a .gguf file, or a folder with *.safetensors
    hf_dir: Path  # folder with config.json and the tokenizer files
    name: str

    @property
    def is_gguf(self) -> bool:
        return self.weights.suffix == ".gguf"

    def hf_config(self) -> dict:
        return json.loads((self.hf_dir / "config.json").read_text())


def resolve(model: str | None) -> ModelFiles:
    """Map a ``--model`` value (None: the default) to its files, or explain."""
    path = Path(model) if model else models_dir() / DEFAULT_GGUF
    if not path.exists():
        hint = " Run `make model` to fetch the default model." if model is None else ""
        raise FileNotFoundError(f"Model not found: {path}.{hint}")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"{path} has no config.json: not a Hugging Face model folder.")
        return ModelFiles(weights=path, hf_dir=path, name=path.name)
    if path.suffix != ".gguf":
        raise ValueError(f"{path}: expected a .gguf file or a Hugging Face model folder.")
    hf_dir = path.with_suffix(".hf")
    if not (hf_dir / "config.json").exists():
        prepare(path)
    name = DEFAULT_SERVED_NAME if path.name == DEFAULT_GGUF else path.stem
    return ModelFiles(weights=path, hf_dir=hf_dir, name=name)


def prepare(gguf_path: Path) -> Path:
    """Write the tokenizer and config held in a GGUF file to ``<name>.hf/``."""
    from transformers import AutoConfig, AutoTokenizer

    from services.gguf_plain import gguf_parsed_once

    hf_dir = gguf_path.with_suffix(".hf")
    tmp_dir = hf_dir.with_name(hf_dir.name + ".tmp")
    kwargs = dict(gguf_file=gguf_path.name)
    # transformers parses the file for the tokenizer, then again for the config, walking the
    # vocabulary with np.memmap's hooks on every slice: one parse over a plain array instead
    # (the default model's: 17.8 -> 7.1 s of CPU, the same files written).
    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        config = AutoConfig.from_pretrained(gguf_path.parent, **kwargs)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tokenizer.save_pretrained(tmp_dir)
    config.save_pretrained(tmp_dir)
    shutil.rmtree(hf_dir, ignore_errors=True)
    tmp_dir.rename(hf_dir)  # atomic: a half-written folder is never seen
    return hf_dir


if __name__ == "__main__":
    for arg in sys.argv[1:] or [str(models_dir() / DEFAULT_GGUF)]:
        print(prepare(Path(arg)))
