"""Block hashes for prefix caching: the chain every process computes alike.

A full block's hash covers its parent's hash, its own token ids and its
extra keys, so equal hashes mean equal whole prefixes, not just equal
blocks. The bytes hashed are a msgpack encoding, which is canonical for
the ints, strings, bytes and None used here; pickle is never involved, so
hashes are the same in every process and Python version: the engine cores
(``services/engine_core/prefix_hash.py`` hashes a request's blocks as it
grows), the KV transfer connectors and the API's prefix-aware routing agree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

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


def salt_keys(cache_salt: str | None, block_index: int) -> tuple[str, ...] | None:
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
            parent, token_ids[index * block_size : (index + 1) * block_size], salt_keys(cache_salt, index)
        )
        hashes.append(parent)
    return hashes
