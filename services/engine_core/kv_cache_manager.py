"""Per-request block tables on top of the block pool, and prefix lookup.

A model whose layers all attend the same way has one KV cache group: one
block table per request. A model mixing full and sliding-window layers
(Gemma 3) has several (``protocol.kv_cache_groups``), each with its own
table, all drawing on the one pool. A window group's table keeps only the
blocks the next tokens can still see: as a request advances, blocks that
fall wholly out of the window are released to the pool (their entries
become the null block), so a long request holds about ``window /
block_size`` blocks per window group however long it grows.

Prefix caching covers every group: a block is published under its hash
and its group, and a hit of ``n`` blocks needs, per group, the blocks the
token after the hit will read — all ``n`` for a full group, the ones
inside the window for a window group.
"""

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


class GroupBlocks(list[KVCacheBlock]):
    """Blocks of KV cache group 0, as a plain list (what single-group callers use), with
    every group's blocks, group 0's included, in ``groups``."""

    def __init__(self, groups: list[list[KVCacheBlock]]) -> None:
        super().__init__(groups[0])
        self.groups = groups


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        max_model_len: int,
        group_windows: Sequence[int | None] = (None,),
        free_out_of_window: bool = True,
    ) -> None:
        """``group_windows``: each KV cache group's sliding window (None: full attention).
        ``free_out_of_window=False`` keeps window groups' old blocks as a full group would
        (the baseline the window-aware freeing is measured against)."""
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        if not group_windows:
            raise ValueError("a KV cache needs at least one group.")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.windows = [w if free_out_of_window else None for w in group_windows]
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.tables: list[dict[str, list[KVCacheBlock]]] = [{} for _ in self.windows]
        # How many leading blocks of each request's table are already in the hash map, per group.
        self.cached_counts: list[dict[str, int]] = [{} for _ in self.windows]
        # Group 0, under the names single-group callers know.
        self.req_to_blocks = self.tables[0]
        self.num_cached_blocks = self.cached_counts[0]
        self._stats = PrefixCacheStats()

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    # ---------------------------------------------------------------- prefix hits

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The longest cached prefix of a request that is not yet running.

        At most ``num_tokens - 1`` tokens are served from the cache: the
        last prompt token must always be computed, because its logits give
        the next token (or its hidden state a pooling request's vector).
        Requests asking for prompt logprobs, and mean-pooling ones, skip the
        cache, since a hit would leave those positions without outputs.

        Only a request's first lookup enters the stats: looking again after a
        preemption, or after a step without room, is not a new query.
        """
        if not self.enable_caching or request.skips_prefix_cache:
            return GroupBlocks([[] for _ in self.windows]), 0
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        num_blocks = len(hashes)
        while True:  # each group may only shorten the hit; stop when all agree
            shortest = num_blocks
            for group in range(self.num_groups):
                shortest = self._longest_hit(group, hashes, shortest)
            if shortest == num_blocks:
                break
            num_blocks = shortest
        hits = GroupBlocks([self._hit_blocks(g, hashes, num_blocks) for g in range(self.num_groups)])
        num_hit_tokens = num_blocks * self.block_size
        if not request.prefix_lookup_counted:  # a preempted request's re-lookup is no new query
            request.prefix_lookup_counted = True
            s = self._stats
            self._stats = PrefixCacheStats(
                s.requests + 1, s.queries + request.num_tokens, s.hits + num_hit_tokens
            )
        return hits, num_hit_tokens

    def _cached(self, group: int, block_hash: bytes) -> KVCacheBlock | None:
        return self.block_pool.get_cached_block(block_hash + _group_key(group))

    def _first_needed(self, group: int, num_tokens: int) -> int:
        """The first block the token at position ``num_tokens`` reads in this group."""
        window = self.windows[group]
        return 0 if window is None else max(0, num_tokens - window + 1) // self.block_size

    def _longest_hit(self, group: int, hashes: list[bytes], limit: int) -> int:
        """The most blocks ``n <= limit`` whose hit this group can serve."""
        if self.windows[group] is None:  # every block from the first: the first miss bounds it
            for index in range(limit):
                if self._cached(group, hashes[index]) is None:
                    return index
            return limit
        for n in range(limit, 0, -1):  # a window group needs only the last few blocks before n
            first = self._first_needed(group, n * self.block_size)
            if all(self._cached(group, h) is not None for h in hashes[first:n]):
                return n
        return 0

    def _hit_blocks(self, group: int, hashes: list[bytes], num_blocks: int) -> list[KVCacheBlock]:
        first = self._first_needed(group, num_blocks * self.block_size)
        blocks = [self.block_pool.null_block] * first
        for block_hash in hashes[first:num_blocks]:
            block = self._cached(group, block_hash)
            assert block is not None, "_longest_hit found each of them cached"
            blocks.append(block)
        return blocks

    # ---------------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> GroupBlocks | None:
        """Give a request room for ``num_new_tokens`` more tokens this step.

        ``new_computed_blocks`` are prefix-cache hits covering the next
        ``num_new_computed_tokens`` tokens (``get_computed_blocks``' blocks).
        Returns the newly allocated blocks, or None when the pool is short;
        then the request's tables are as they were, except that window
        blocks it can no longer read may have gone back to the pool.
        ``delay_cache_blocks`` keeps the new blocks out of the prefix cache
        until ``cache_blocks`` (their KV is loaded from another engine over
        several steps, and must not be shared before).
        """
        assert num_new_tokens > 0, "schedule at least one token"
        rid = request.request_id
        hits = getattr(new_computed_blocks, "groups", None)
        if hits is None:  # a plain list: group 0's hits (one group), or no hits at all
            if new_computed_blocks and self.num_groups > 1:
                raise ValueError(
                    "With several KV cache groups, prefix hits come as get_computed_blocks gives them."
                )
            hits = [list(new_computed_blocks)] + [[] for _ in range(self.num_groups - 1)]
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        tables = [t.setdefault(rid, []) for t in self.tables]
        for group, blocks in enumerate(tables):
            self._release_out_of_window(group, blocks, request.num_computed_tokens)
        needed = [max(_cdiv(num_slots, self.block_size) - len(b) - len(h), 0) for b, h in zip(tables, hits)]
        # A hit on a free block takes it off the free queue as well.
        revived = sum(1 for h in hits for b in h if b.ref_cnt == 0 and not b.is_null)
        if sum(needed) + revived > self.block_pool.get_num_free_blocks():
            if not any(tables):
                for t in self.tables:
                    del t[rid]
            return None
        # Every group's hits leave the free queue before any group takes new blocks from it:
        # a hit of group 2 must not be handed out (and overwritten) as a new block of group 1.
        for group, (blocks, group_hits) in enumerate(zip(tables, hits)):
            if group_hits:
                assert not blocks, "prefix hits only extend an empty block table"
                self.block_pool.touch(group_hits)
                blocks.extend(group_hits)
                self.cached_counts[group][rid] = len(group_hits)
        new = [self.block_pool.get_new_blocks(count) for count in needed]
        for blocks, new_blocks in zip(tables, new):
            blocks.extend(new_blocks)
        if not delay_cache_blocks:
            self._cache_full_blocks(request, num_computed + num_new_tokens)
        return GroupBlocks(new)

    def _release_out_of_window(self, group: int, blocks: list[KVCacheBlock], num_computed: int) -> None:
        """Hand back the blocks no token from ``num_computed`` on can read; their entries
        become the null block (the worker never reads them: ``layers/sliding_window.py``)."""
        end = min(self._first_needed(group, num_computed), len(blocks))
        null = self.block_pool.null_block
        stale = [b for b in blocks[:end] if not b.is_null]
        if not stale:
            return
        for index in range(end):
            blocks[index] = null
        self.block_pool.touch([null] * len(stale))  # the table holds one null reference per entry
        self.block_pool.free_blocks(reversed(stale))  # newest first, so the oldest is evicted last

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
        for group in range(self.num_groups):
            counts = self.cached_counts[group]
            num_cached = counts.get(request.request_id, 0)
            if num_full <= num_cached:
                continue
            blocks = self.tables[group][request.request_id]
            self.block_pool.cache_full_blocks(
                request, blocks, num_cached, num_full, key_suffix=_group_key(group)
            )
            counts[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first so its tail is evicted first."""
        for group in range(self.num_groups):
            blocks = self.tables[group].pop(request.request_id, [])
            num_cached = self.cached_counts[group].pop(request.request_id, 0)
            # Blocks are published when allocated, before the step computes them.
            # A request preempted in the very step that scheduled it never gets
            # them computed: their hashes must go, or a later hit reads garbage.
            # (No one else can hold them: that step makes no prefix lookups.)
            for block in blocks[request.num_computed_tokens // self.block_size : num_cached]:
                if not block.is_null:
                    assert block.ref_cnt == 1, block
                    self.block_pool.uncache_block(block)
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The block tables of groups 1.. (group 0's is ``get_block_ids``)."""
        return [[b.block_id for b in t.get(request_id, ())] for t in self.tables[1:]]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks a request holds over all groups (null entries excluded)."""
        return sum(1 for t in self.tables for b in t.get(request_id, ()) if not b.is_null)

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def all_blocks_free(self) -> bool:
        """True when every usable block is back in the free queue (no leak)."""
        return (
            not any(self.tables) and self.block_pool.get_num_free_blocks() == self.block_pool.num_blocks - 1
        )


def _group_key(group: int) -> bytes:
    """Appended to a block's hash in the pool: the same tokens in two groups are two blocks."""
    return b"" if group == 0 else b"#kv-group-%d" % group
