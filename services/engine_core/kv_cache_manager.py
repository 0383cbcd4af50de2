"""Per-request block tables on top of the block pool, and prefix lookup."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.engine_core.block_pool import BlockPool, KVCacheBlock
from services.engine_core.request import Request


@dataclass(frozen=True)
class PrefixCacheStats:
    requests: int = 0  # lookups made
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found in the cache


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool, max_model_len: int
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the hash map.
        self.num_cached_blocks: dict[str, int] = {}
        self._stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a request that is not yet running.

        At most ``num_tokens - 1`` tokens are served from the cache: the
        last prompt token must always be computed, because its logits give
        the next token. Requests asking for prompt logprobs skip the cache,
        since a hit would leave those positions without logits.

        Only a request's first lookup enters the stats: looking again after a
        preemption, or after a step without room, is not a new query.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break  # hashes chain, so every later block misses too
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        if not request.prefix_lookup_counted:
            request.prefix_lookup_counted = True
            s = self._stats
            self._stats = PrefixCacheStats(
                s.requests + 1, s.queries + request.num_tokens, s.hits + num_hit_tokens
            )
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Give a request room for ``num_new_tokens`` more tokens this step.

        ``new_computed_blocks`` are prefix-cache hits covering the next
        ``num_new_computed_tokens`` tokens. Returns the newly allocated
        blocks, or None when the pool is short, in which case nothing at
        all has changed. ``delay_cache_blocks`` keeps the new blocks out of
        the prefix cache until ``cache_blocks`` (their KV is loaded from
        another engine over several steps, and must not be shared before).
        """
        assert num_new_tokens > 0, "schedule at least one token"
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_new_blocks = max(
            _cdiv(num_slots, self.block_size) - len(blocks) - len(new_computed_blocks), 0
        )
        # A hit on a free block takes it off the free queue as well.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        if num_new_blocks + num_revived > self.block_pool.get_num_free_blocks():
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None

        if new_computed_blocks:
            assert not blocks, "prefix hits only extend an empty block table"
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        if not delay_cache_blocks:
            self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's full blocks up to ``num_computed_tokens`` (see ``delay_cache_blocks``)."""
        self._cache_full_blocks(request, num_computed_tokens)

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        if not self.enable_caching:
            return
        # Never beyond the request's real tokens: lookahead slots hold
        # unverified draft tokens that must not become shareable.
        num_full = min(num_tokens_after_step, request.num_tokens) // self.block_size
        num_full = min(num_full, len(request.block_hashes))
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= num_cached:
            return
        blocks = self.req_to_blocks[request.request_id]
        self.block_pool.cache_full_blocks(request, blocks, num_cached, num_full)
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first so its tail is evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        num_cached = self.num_cached_blocks.pop(request.request_id, 0)
        # Blocks are published when allocated, before the step computes them.
        # A request preempted in the very step that scheduled it never gets
        # them computed: their hashes must go, or a later hit reads garbage.
        # (No one else can hold them: that step makes no prefix lookups.)
        for block in blocks[request.num_computed_tokens // self.block_size:num_cached]:
            assert block.ref_cnt == 1, block
            self.block_pool.uncache_block(block)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def all_blocks_free(self) -> bool:
        """True when every usable block is back in the free queue (no leak)."""
        return (
            not self.req_to_blocks
            and self.block_pool.get_num_free_blocks() == self.block_pool.num_blocks - 1
        )
