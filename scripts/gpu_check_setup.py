"""scripts/gpu_check.sh's setup step: the machine recorded, the bundle's missing wheels installed.

    python scripts/gpu_check_setup.py BUNDLE TARGET

Exit status 2 where the machine cannot run the check (no torch, Triton or CUDA device), 3 where
there is no bundle, 1 where installing or importing failed. Only the wheels whose distribution
this machine lacks are installed (``pip --no-index --no-deps --target``), so the image's own
packages are never shadowed. Without pip, the wheels are unzipped there (what pip would put).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import re
import subprocess
import sys
import zipfile
from pathlib import Path

# What the check imports first that the device image lacks (scripts/gpu_bundle.py).
CHECK_IMPORTS = (
    "msgspec",
    "zmq",
    "gguf",
    "xgrammar",
    "starlette",
    "uvicorn",
    "ahocorasick",
    "openai",
    "pytest_asyncio",
)


def machine() -> int:
    try:
        import torch
        import triton
    except ImportError as exc:
        print(f"torch with CUDA and triton must be installed: {exc}")
        return 2
    if not torch.cuda.is_available():
        print(f"torch {torch.__version__} sees no CUDA device")
        return 2
    p = torch.cuda.get_device_properties(0)
    print(
        f"gpu_check | device: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm{p.major}{p.minor}, "
        f"{torch.cuda.device_count()} visible; torch {torch.__version__}, triton {triton.__version__}, "
        f"python {sys.version.split()[0]}"
    )
    return 0


def missing_wheels(wheels: Path) -> list[Path]:
    found = []
    for wheel in sorted(wheels.glob("*.whl")):
        name = re.sub(r"[-_.]+", "-", wheel.name.split("-", 1)[0]).lower()
        try:
            md.distribution(name)
        except md.PackageNotFoundError:
            found.append(wheel)
    return found


def main(bundle: Path, target: Path) -> int:
    status = machine()
    if status:
        return status
    if not (bundle / "wheels").is_dir():
        print(f"no bundle at {bundle}: run `make gpu-bundle` on a machine with PyPI and copy it over")
        return 3
    wheels = missing_wheels(bundle / "wheels")
    names = " ".join(w.name.split("-", 2)[0] + "-" + w.name.split("-", 2)[1] for w in wheels)
    print(f"gpu_check | bundle: {len(wheels)} wheel(s) this machine lacks: {names or 'none'}")
    if wheels and importlib.util.find_spec("pip") is None:  # a wheel is a zip of what --target holds
        for wheel in wheels:
            zipfile.ZipFile(wheel).extractall(target)
    elif wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
             "--target", str(target), *map(str, wheels)],
            check=True,
        )  # fmt: skip
    sys.path.insert(0, str(target))
    for module in CHECK_IMPORTS:
        __import__(module)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
