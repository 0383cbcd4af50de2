from __future__ import annotations

from protocol import SamplingParams
from services.engine_core.kv_cache_manager import KVCacheManager
from services.engine_core.prefix_hash import make_block_hasher
from services.engine_core.request import Request

BLOCK = 16


def manager(num_blocks: int = 11, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK, caching, max_model_len=1024)


def request(request_id: str, prompt: list[int], **sampling) -> Request:
    return Request(request_id, prompt, SamplingParams(**sampling), 0.0, block_hasher=make_block_hasher(BLOCK))


def run_prefill(kv: KVCacheManager, r: Request) -> int:
    """Admit a request with its prefix hit and compute the whole prompt; returns the hit."""
    blocks, num_hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - num_hit, num_hit, blocks) is not None
    r.num_computed_tokens = r.num_tokens
    return num_hit


def test_full_blocks_are_shared_and_the_partial_one_is_not():
    kv = manager()
    prompt = list(range(56))  # 3 full blocks + 8 tokens
    first = request("a", prompt)
    assert run_prefill(kv, first) == 0
    second = request("b", prompt[:48] + [999] * 5)
    assert run_prefill(kv, second) == 48
    a_ids, b_ids = kv.get_block_ids("a"), kv.get_block_ids("b")
    assert a_ids[:3] == b_ids[:3] and a_ids[3] != b_ids[3]
    stats = kv.take_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 56 + 53, 48)
    assert kv.take_prefix_cache_stats().queries == 0
    kv.free(first)
    kv.free(second)
    assert kv.all_blocks_free()


def test_the_last_prompt_token_is_never_served_from_the_cache():
    kv = manager()
    prompt = list(range(48))  # exactly 3 full blocks
    run_prefill(kv, request("a", prompt))
    again = request("b", prompt)
    blocks, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 32 and len(blocks) == 2  # the third block holds the last token


def test_prompt_logprobs_and_disabled_caching_skip_the_lookup():
    kv = manager()
    prompt = list(range(40))
    run_prefill(kv, request("a", prompt))
    assert kv.get_computed_blocks(request("b", prompt, prompt_logprobs=1)) == ([], 0)
    off = manager(caching=False)
    run_prefill(off, request("a", prompt))
    assert off.get_computed_blocks(request("b", prompt)) == ([], 0)
    assert all(b.block_hash is None for b in off.block_pool.blocks)


def test_allocation_failure_changes_nothing():
    kv = manager(num_blocks=5)  # 4 usable blocks
    holder = request("a", list(range(40)))
    run_prefill(kv, holder)  # 3 blocks
    kv.free(holder)  # all free again, but 2 full blocks stay cached
    big = request("b", list(range(32)) + [7] * 40)  # 72 tokens: hits 2 blocks, needs 3 more
    blocks, num_hit = kv.get_computed_blocks(big)
    assert num_hit == 32
    free_before = [b.block_id for b in kv.block_pool.free_block_queue]
    assert kv.allocate_slots(big, big.num_tokens - num_hit, num_hit, blocks) is None
    assert [b.block_id for b in kv.block_pool.free_block_queue] == free_before
    assert all(b.ref_cnt == 0 for b in blocks)
    assert kv.get_block_ids("b") == [] and kv.all_blocks_free()


def test_allocate_returns_only_the_new_blocks_and_caches_as_blocks_fill():
    kv = manager()
    r = request("a", list(range(20)))
    new = kv.allocate_slots(r, 20)
    assert len(new) == 2 and kv.get_block_ids("a") == [b.block_id for b in new]
    assert new[0].block_hash == r.block_hashes[0] and new[1].block_hash is None
    r.num_computed_tokens = 20
    for token in range(12):  # decode until the second block is full
        r.append_output_token_ids(token)
        assert kv.allocate_slots(r, 1) == []
        r.num_computed_tokens += 1
    assert new[1].block_hash == r.block_hashes[1]
    r.append_output_token_ids(99)
    assert len(kv.allocate_slots(r, 1)) == 1  # token 33 needs a third block


def test_lookahead_slots_are_allocated_but_never_cached():
    kv = manager()
    r = request("a", list(range(17)))
    new = kv.allocate_slots(r, 17, num_lookahead_tokens=20)
    assert len(new) == 3  # 37 slots
    # Only the first block is full of real tokens; draft slots stay private.
    assert [b.block_hash is not None for b in new] == [True, False, False]
    kv.free(r)
    assert kv.all_blocks_free()


def test_free_releases_tail_first_so_the_tail_is_evicted_first():
    kv = manager()
    r = request("a", list(range(48)))
    run_prefill(kv, r)
    ids = kv.get_block_ids("a")
    kv.free(r)
    tail = [b.block_id for b in kv.block_pool.free_block_queue][-3:]
    assert tail == ids[::-1]
    assert kv.all_blocks_free()


def test_blocks_freed_before_they_were_computed_are_not_left_in_the_cache():
    kv = manager()
    r = request("a", list(range(40)))
    r.num_computed_tokens = 16
    kv.allocate_slots(r, 16)  # table for 32 tokens; both full blocks published
    computed, uncomputed = kv.req_to_blocks["a"]
    assert uncomputed.block_hash is not None
    kv.free(r)  # preempted before the step ran: only the first block holds KV
    assert computed.block_hash is not None and uncomputed.block_hash is None
    assert kv.get_computed_blocks(request("b", list(range(40))))[1] == 16
