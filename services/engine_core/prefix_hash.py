"""A request's block hashes for prefix caching, computed as its tokens grow.

The hash chain itself (``hash_block_tokens``, the cache salt's place in it)
is ``protocol/block_hashes.py``'s, shared with the KV transfer connectors and
the API's prefix-aware routing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.block_hashes import hash_block_tokens, salt_keys

if TYPE_CHECKING:
    from services.engine_core.request import BlockHasher, Request


def _extra_keys(request: Request, block_index: int) -> tuple[str, ...] | None:
    return salt_keys(request.cache_salt, block_index)


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
