"""The namespace of KV blocks: which checkpoint computed them.

Blocks are keyed ``namespace + prefix-cache block hash``. The hash covers
the token ids only, so the namespace must tell apart every pair of engines
whose KV differs for equal tokens: other weights, dtype or block size. It is
a digest of the checkpoint itself (its files' sizes and sampled contents,
config.json whole), never of its name: two different models both called
``llama.gguf`` never exchange blocks, and one model under two paths does.

Sampling keeps this cheap for any size (16 windows of 64 KiB per file); a
checkpoint that differs only outside every window (a fine-tune that changes
a few bytes mid-file) would share a namespace -- recorded as a limit.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path

from protocol import EngineConfig

logger = logging.getLogger(__name__)

NAMESPACE_BYTES = 8
_WINDOWS = 16
_WINDOW_BYTES = 64 << 10
_MAX_FILES = 256  # a checkpoint folder with more regular files than this is hashed on its first ones


def block_namespace(config: EngineConfig) -> bytes:
    """``NAMESPACE_BYTES`` bytes that differ between engines whose blocks are not interchangeable."""
    model = config.model
    digest = hashlib.sha256(b"weft-kv-namespace-v2\0")
    for part in (model.dtype, model.load_format, model.vocab_size, config.cache.block_size):
        digest.update(f"{part}\0".encode())
    if model.load_format == "dummy":
        digest.update(f"dummy seed {model.seed}\0".encode())  # random weights: only equal seeds agree
    else:
        digest.update(checkpoint_digest(model.model))
    return digest.digest()[:NAMESPACE_BYTES]


def checkpoint_digest(path: str | os.PathLike) -> bytes:
    """A digest of a GGUF file or a checkpoint folder's regular files (not their names' folder)."""
    root = Path(path)
    digest = hashlib.sha256()
    try:
        if root.is_dir():
            files = [p for p in sorted(root.iterdir()) if p.is_file()][:_MAX_FILES]
            for file in files:
                digest.update(file.name.encode() + b"\0")  # names inside a checkpoint are its structure
                _digest_file(file, digest)
        else:
            _digest_file(root, digest)
    except OSError as e:
        # No readable checkpoint (an engine that will not load one either): fall back on the path.
        logger.warning("KV namespace: cannot read the checkpoint %s (%s); using its path.", root, e)
        digest.update(b"path\0" + str(root.resolve()).encode())
    return digest.digest()


def _digest_file(path: Path, digest) -> None:
    with open(path, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        size = info.st_size
        digest.update(size.to_bytes(8, "little"))
        if size <= _WINDOWS * _WINDOW_BYTES:
            digest.update(f.read())
            return
        step = (size - _WINDOW_BYTES) // (_WINDOWS - 1)
        for i in range(_WINDOWS):  # the first and the last window included
            f.seek(i * step)
            digest.update(f.read(_WINDOW_BYTES))
