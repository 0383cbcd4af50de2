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
    return _salt_keys(request.cache_salt, block_index)


def _salt_keys(cache_salt: str | None, block_index: int) -> tuple[str, ...] | None:
    # The salt only needs to be in the first block: every later hash chains
    # through it, so a different salt already changes them all.
    if block_index == 0 and cache_salt is not None:
        return (cache_salt,)
    return None


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None, max_blocks: int | None = None
) -> list[bytes]:
    """The hashes an engine gives the prompt's full blocks (the first ``max_blocks``).

    For the API's prefix-aware routing: torch-free, and the same chain as
    ``make_block_hasher`` computes for a request.
    """
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    hashes: list[bytes] = []
    parent = None
    for index in range(num_blocks):
        parent = hash_block_tokens(
            parent, token_ids[index * block_size : (index + 1) * block_size], _salt_keys(cache_salt, index)
        )
        hashes.append(parent)
    return hashes


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
            tokens = request.all_token_ids[index * block_size : (index + 1) * block_size]
            parent = hash_block_tokens(parent, tokens, _extra_keys(request, index))
            hashes.append(parent)
        return hashes

    return hash_new_full_blocks
