"""The pool of KV cache blocks: free queue, reference counts, hash map.

A block whose reference count drops to 0 goes to the tail of the free
queue but keeps its hash (lazy eviction): a later request with the same
prefix can still hit it, until the queue hands the block out again and
only then is its hash forgotten. The head of the queue is therefore the
least recently used free block.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

if TYPE_CHECKING:
    from services.engine_core.request import Request


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set once the block is full and cached
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order, as an intrusive doubly linked list.

    Why not a deque: a prefix-cache hit must pull a free block out of the
    *middle* of the queue. The links live on the blocks themselves, so that
    removal is O(1) and allocates nothing; sentinel head and tail nodes
    remove every empty/one-element special case.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        assert block is not None  # the head links to the tail at least
        if block is self._tail:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, {self.num_free_blocks} available")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free_block is None and block.next_free_block is None, block
        last = self._tail.prev_free_block
        assert last is not None  # the tail links back to the head at least
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Free blocks from head (evicted first) to tail."""
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free_block


class BlockPool:
    """All KV blocks of one engine core; block 0 is the null block.

    The null block is a placeholder that is never handed out, freed or
    counted, so ``num_blocks`` blocks give ``num_blocks - 1`` usable ones.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # Several blocks may carry one hash (two requests filled the same
        # prefix at once); we keep them all rather than rewrite block tables.
        self.cached_blocks: dict[bytes, dict[int, KVCacheBlock]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # KV cache events, when enabled (enable_kv_events): appended here, taken by the engine each step.
        self.kv_events: list[KVCacheEvent] | None = None
        self._event_block_size = 0
        self._event_medium = "GPU"
        self._event_token_ids = True

    def enable_kv_events(self, block_size: int, medium: str, *, token_ids: bool = True) -> None:
        """``token_ids`` False: BlockStored carries hashes only (no prompt text leaves the engine)."""
        self.kv_events = []
        self._event_block_size = block_size
        self._event_medium = medium
        self._event_token_ids = token_ids

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first."""
        if not self.kv_events:
            return []
        events, self.kv_events = self.kv_events, []
        return events

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, block
            self.uncache_block(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the tail in this order."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.append(block)

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        key_suffix: bytes = b"",
    ) -> None:
        """Publish ``blocks[num_cached_blocks:num_full_blocks]`` under the request's hashes
        (each followed by ``key_suffix``: a KV cache group's blocks are keyed apart)."""
        if not self.enable_caching:
            return
        new_hashes: list[int] = []  # indexes of hashes the cache did not hold yet
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.is_null:
                continue
            assert block.block_hash is None, block
            block_hash = request.block_hashes[index] + key_suffix
            block.block_hash = block_hash
            same_hash = self.cached_blocks.setdefault(block_hash, {})
            if not same_hash:
                new_hashes.append(index)
            same_hash[block.block_id] = block
        if self.kv_events is not None and new_hashes:
            self._record_stored(request, new_hashes)

    def _record_stored(self, request: Request, indexes: list[int]) -> None:
        """One BlockStored per run of consecutive new hashes (a run chains to its parent)."""
        events = self.kv_events
        assert events is not None, "called only with KV cache events enabled"
        runs: list[list[int]] = []
        for index in indexes:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            first, last = run[0], run[-1]
            block_size = self._event_block_size
            events.append(
                BlockStored(
                    block_hashes=[request.block_hashes[i] for i in run],
                    parent_block_hash=request.block_hashes[first - 1] if first > 0 else None,
                    token_ids=(
                        list(request.all_token_ids[first * block_size : (last + 1) * block_size])
                        if self._event_token_ids
                        else []
                    ),
                    block_size=block_size,
                    medium=self._event_medium,
                )
            )

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        same_hash = self.cached_blocks.get(block_hash)
        if not same_hash:
            return None
        return next(iter(same_hash.values()))

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
        return True

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget a block's hash: it is handed out again, or its KV was never written."""
        if block.block_hash is None:
            return
        same_hash = self.cached_blocks[block.block_hash]
        del same_hash[block.block_id]
        if not same_hash:
            del self.cached_blocks[block.block_hash]
            if self.kv_events is not None:
                self.kv_events.append(
                    BlockRemoved(block_hashes=[block.block_hash], medium=self._event_medium)
                )
        block.block_hash = None
