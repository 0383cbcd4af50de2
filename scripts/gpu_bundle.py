"""The GPU check's bundle: what a bare device machine lacks, gathered here, installed there offline.

    python scripts/gpu_bundle.py [DEST]      # `make gpu-bundle`: DEST defaults to .gpu-bundle/

The lent device machines (one H100 or H200, no network) run Python 3.12 with a CUDA torch, Triton
and the distributions in ``IMAGE``; ``scripts/gpu_check.sh`` runs weft there from a copy of this
repository. This writes, into one folder (ignored by git, under ``LIMIT_BYTES``):

- ``wheels/``: cp312 manylinux wheels (``--only-binary=:all: --no-deps``) of every distribution in
  ``BUNDLE``, at the versions of ``requirements-dev.lock`` (the tests' too). ``BUNDLE`` is what the check imports (weft's
  runtime, the kernel tests, the openai client its serve step uses) and the device image lacks, its
  dependencies included, resolved against the packages' metadata
  (``tests/repo/test_gpu_bundle.py`` recomputes it). The check installs only the wheels whose
  distribution the machine lacks, so a few kept for safety (the image's own dependencies, such as
  pydantic, which another transformers release may not bring) shadow nothing.
- ``models/SmolLM2-135M-Instruct.Q4_1.hf/``: the default model's config and tokenizer. Its GGUF
  (94 MiB) does not fit the bundle's limit: the check runs the default model's shape with random
  weights (``--load-format dummy``) unless ``models/`` beside the repo holds the GGUF.

Needs PyPI (``pip download``); ``make test`` never runs it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIMIT_BYTES = 60 << 20
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")

# What the device image holds (the issue that lent it), with their own dependencies.
IMAGE = (
    "torch",
    "triton",
    "transformers",
    "httpx",
    "pytest",
    "pytest-timeout",
    "pytest-xdist",
    "numpy",
    "safetensors",
    "tokenizers",
    "prometheus-client",
    "uvloop",
)
# Distributions the check needs that no import names: the pytest plugin pyproject's ini options
# ask for (asyncio_mode), and the client of the serve step.
CHECK_EXTRA = ("pytest-asyncio", "openai")
# What the image lacks, dependencies included; the last line are kept for safety (see above).
BUNDLE = (
    "msgspec", "pyzmq", "gguf", "requests", "urllib3", "charset-normalizer",
    "xgrammar", "apache-tvm-ffi", "starlette", "uvicorn", "pyahocorasick",
    "pytest-asyncio", "openai", "jiter", "sniffio",
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "anyio", "h11", "jinja2",
    "markupsafe", "pyyaml", "tqdm", "typing-extensions", "idna", "certifi",
)  # fmt: skip
DEFAULT_MODEL_HF = "SmolLM2-135M-Instruct.Q4_1.hf"


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_versions() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements-dev.lock").read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and not name.startswith("#"):
            pins[normalized(name)] = version
    return pins


def pinned_bundle() -> list[str]:
    """``BUNDLE`` at the lock's versions (a distribution the lock lacks is a ValueError)."""
    pins = locked_versions()
    missing = [name for name in BUNDLE if normalized(name) not in pins]
    if missing:
        raise ValueError(f"requirements-dev.lock pins none of {missing}: pin them or drop them from BUNDLE.")
    return [f"{name}=={pins[normalized(name)]}" for name in BUNDLE]


def wheel_distribution(filename: str) -> str:
    """A wheel file's distribution name, normalized (``pydantic_core-2.5-cp312-...whl``)."""
    return normalized(filename.split("-", 1)[0])


def main(argv: list[str]) -> int:
    dest = Path(argv[0]) if argv else REPO / ".gpu-bundle"
    wheels = dest / "wheels"
    shutil.rmtree(dest, ignore_errors=True)
    wheels.mkdir(parents=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--no-deps",
         "--python-version", PYTHON_VERSION, "--implementation", "cp", *platforms,
         "--dest", str(wheels), *pinned_bundle()],
        check=True,
    )  # fmt: skip
    got = {wheel_distribution(p.name) for p in wheels.glob("*.whl")}
    lacking = sorted({normalized(n) for n in BUNDLE} - got)
    if lacking:
        raise SystemExit(f"gpu-bundle: no wheel came for {lacking}.")
    source = REPO / "models" / DEFAULT_MODEL_HF
    if not (source / "config.json").exists():
        raise SystemExit(f"gpu-bundle: {source} is missing: run `make model` first.")
    shutil.copytree(source, dest / "models" / DEFAULT_MODEL_HF)
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    if size > LIMIT_BYTES:
        raise SystemExit(f"gpu-bundle: {size / 2**20:.1f} MiB, over the {LIMIT_BYTES >> 20} MiB limit.")
    print(
        f"gpu-bundle: {len(got)} wheels and the default model's config and tokenizer in {dest}, {size / 2**20:.1f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
