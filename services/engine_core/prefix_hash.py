"""Block hashes for prefix caching.

A full block's hash covers its parent's hash, its own token ids and its
extra keys, so equal hashes mean equal whole prefixes, not just equal
blocks. The bytes hashed are a msgpack encoding, which is canonical for
the ints, strings, bytes and None used here; pickle is never involved, so
hashes are the same in every process and Python version.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from services.engine_core.request import BlockHasher, Request

# The parent of every first block. A fixed value (not random per process as
# in vLLM) so that engine cores and the KV transfer service agree on hashes.
NONE_HASH: bytes = hashlib.sha256(b"weft prefix cache: no parent block").digest()

_encoder = msgspec.msgpack.Encoder()


def hash_block_tokens(
    parent_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: tuple[str, ...] | None = None,
) -> bytes:
    """SHA-256 of (parent or NONE_HASH, token ids, extra keys or None)."""
    parent = NONE_HASH if parent_hash is None else parent_hash
    payload = _encoder.encode((parent, list(token_ids), extra_keys))
    return hashlib.sha256(payload).digest()


def _extra_keys(request: Request, block_index: int) -> tuple[str, ...] | None:
    # The salt only needs to be in the first block: every later hash chains
    # through it, so a different salt already changes them all.
    if block_index == 0 and request.cache_salt is not None:
        return (request.cache_salt,)
    return None


def make_block_hasher(block_size: int) -> BlockHasher:
    """Return ``(request) -> list[bytes]``: hashes of its not-yet-hashed full blocks."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}.")

    def hash_new_full_blocks(request: Request) -> list[bytes]:
        start = len(request.block_hashes)
        end = request.num_tokens // block_size
        parent = request.block_hashes[-1] if request.block_hashes else None
        hashes = []
        for index in range(start, end):
            tokens = request.all_token_ids[index * block_size:(index + 1) * block_size]
            parent = hash_block_tokens(parent, tokens, _extra_keys(request, index))
            hashes.append(parent)
        return hashes

    return hash_new_full_blocks
