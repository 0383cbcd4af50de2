from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.engine_core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def make_queue(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


class TestFreeQueue:
    def test_starts_in_block_id_order(self):
        _, queue = make_queue(5)
        assert ids(queue) == [0, 1, 2, 3, 4]
        assert queue.num_free_blocks == 5

    def test_remove_from_the_middle_keeps_the_order(self):
        blocks, queue = make_queue(5)
        queue.remove(blocks[2])
        assert ids(queue) == [0, 1, 3, 4]
        assert queue.num_free_blocks == 4
        assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
        queue.remove(blocks[0])  # the head
        queue.remove(blocks[4])  # the tail
        assert ids(queue) == [1, 3]

    def test_popleft_takes_the_head_and_append_goes_to_the_tail(self):
        blocks, queue = make_queue(4)
        assert queue.popleft() is blocks[0]
        assert ids(queue.popleft_n(2)) == [1, 2]
        queue.append(blocks[1])
        queue.append_n([blocks[0], blocks[2]])
        assert ids(queue) == [3, 1, 0, 2]
        assert queue.num_free_blocks == 4

    def test_empty_queue_refuses_to_pop(self):
        blocks, queue = make_queue(2)
        queue.popleft_n(2)
        assert queue.num_free_blocks == 0 and ids(queue) == []
        with pytest.raises(ValueError, match="No free blocks"):
            queue.popleft()
        with pytest.raises(ValueError):
            queue.popleft_n(1)
        queue.append(blocks[1])
        assert ids(queue) == [1]

    def test_removing_a_block_twice_is_an_error(self):
        blocks, queue = make_queue(3)
        queue.remove(blocks[1])
        with pytest.raises(RuntimeError):
            queue.remove(blocks[1])


class TestBlockPool:
    def test_block_zero_is_the_null_block(self):
        pool = BlockPool(5, enable_caching=True)
        assert pool.null_block.block_id == 0 and pool.null_block.is_null
        assert pool.get_num_free_blocks() == 4
        assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 4]
        assert pool.get_usage() == 1.0
        with pytest.raises(ValueError):
            BlockPool(1, enable_caching=True)

    def test_usage_counts_usable_blocks_only(self):
        pool = BlockPool(5, enable_caching=False)
        blocks = pool.get_new_blocks(1)
        assert pool.get_usage() == pytest.approx(0.25)
        pool.free_blocks(blocks)
        assert pool.get_usage() == 0.0

    def test_freed_blocks_keep_their_hash_until_handed_out_again(self):
        pool = BlockPool(4, enable_caching=True)
        a, b, c = pool.get_new_blocks(3)
        request = SimpleNamespace(block_hashes=[b"A", b"B", b"C"])
        pool.cache_full_blocks(request, [a, b, c], num_cached_blocks=0, num_full_blocks=3)
        assert pool.get_cached_block(b"C") is c
        # Freed tail-first, as the KV cache manager frees a request.
        pool.free_blocks([c, b, a])
        assert ids(pool.free_block_queue) == [3, 2, 1]
        assert pool.get_cached_block(b"B") is b  # lazy eviction: still a hit
        pool.touch([b])  # a prefix hit revives it from the middle of the queue
        assert b.ref_cnt == 1 and ids(pool.free_block_queue) == [3, 1]

        # LRU: the head (c, freed first) is evicted first, then a.
        assert pool.get_new_blocks(1) == [c]
        assert pool.get_cached_block(b"C") is None and c.block_hash is None
        assert pool.get_cached_block(b"A") is a
        assert pool.get_new_blocks(1) == [a]
        assert pool.get_cached_block(b"A") is None
        assert pool.get_cached_block(b"B") is b

    def test_shared_block_is_freed_only_by_its_last_user(self):
        pool = BlockPool(3, enable_caching=True)
        (block,) = pool.get_new_blocks(1)
        pool.touch([block])
        pool.free_blocks([block])
        assert pool.get_num_free_blocks() == 1
        pool.free_blocks([block])
        assert pool.get_num_free_blocks() == 2

    def test_two_blocks_may_carry_one_hash(self):
        pool = BlockPool(3, enable_caching=True)
        a, b = pool.get_new_blocks(2)
        request = SimpleNamespace(block_hashes=[b"S"])
        pool.cache_full_blocks(request, [a], 0, 1)
        pool.cache_full_blocks(request, [b], 0, 1)
        pool.free_blocks([a, b])
        assert pool.get_new_blocks(1) == [a]  # evicts a's entry only
        assert pool.get_cached_block(b"S") is b

    def test_caching_off_publishes_nothing(self):
        pool = BlockPool(3, enable_caching=False)
        (block,) = pool.get_new_blocks(1)
        pool.cache_full_blocks(SimpleNamespace(block_hashes=[b"X"]), [block], 0, 1)
        assert pool.get_cached_block(b"X") is None

    def test_reset_prefix_cache_only_when_everything_is_free(self):
        pool = BlockPool(3, enable_caching=True)
        (block,) = pool.get_new_blocks(1)
        pool.cache_full_blocks(SimpleNamespace(block_hashes=[b"X"]), [block], 0, 1)
        assert not pool.reset_prefix_cache()
        pool.free_blocks([block])
        assert pool.reset_prefix_cache()
        assert pool.get_cached_block(b"X") is None and block.block_hash is None
