"""The KV cache manager with sliding-window groups (hand-made requests, no model).

Layout as Gemma 3's, scaled down: group 0 full attention, groups 1 and 2
with a 64-token window, 16-token blocks.
"""

from __future__ import annotations

import pytest

from protocol import SamplingParams
from protocol.kv_cache_groups import KVCacheGroup, kv_cache_groups, layer_placement
from services.engine_core.kv_cache_manager import KVCacheManager
from services.engine_core.prefix_hash import make_block_hasher
from services.engine_core.request import Request

BLOCK, WINDOW = 16, 64
GROUPS = [None, WINDOW, WINDOW]


def manager(num_blocks: int = 200, free_out_of_window: bool = True) -> KVCacheManager:
    return KVCacheManager(
        num_blocks,
        BLOCK,
        True,
        max_model_len=4096,
        group_windows=GROUPS,
        free_out_of_window=free_out_of_window,
    )


def request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(), 0.0, block_hasher=make_block_hasher(BLOCK))


def prefill(kv: KVCacheManager, r: Request, chunk: int | None = None) -> int:
    """Admit with the prefix hit and compute the prompt in chunks; returns the hit in tokens."""
    hits, num_hit = kv.get_computed_blocks(r)
    first = r.num_tokens - num_hit if chunk is None else min(chunk, r.num_tokens - num_hit)
    assert kv.allocate_slots(r, first, num_hit, hits) is not None
    r.num_computed_tokens = num_hit + first
    while r.num_computed_tokens < r.num_tokens:
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        assert kv.allocate_slots(r, n) is not None
        r.num_computed_tokens += n
    return num_hit


def decode(kv: KVCacheManager, r: Request, steps: int, token: int = 7) -> None:
    for _ in range(steps):
        r.append_output_token_ids(token)
        assert kv.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1


def held(kv: KVCacheManager, r: Request) -> list[int]:
    """Real (non-null) blocks per group."""
    return [sum(1 for b in t[r.request_id] if not b.is_null) for t in kv.tables]


def test_gemma3_layers_make_six_groups_of_three_full_first():
    windows = [0 if (i + 1) % 6 == 0 else 512 for i in range(18)]
    groups = kv_cache_groups(windows, 18)
    assert groups[0] == KVCacheGroup(None, (5, 11, 17))
    assert [g.window for g in groups] == [None] + [512] * 5 and all(len(g.layers) == 3 for g in groups)
    assert groups[2].layers == (3, 4, 6) and layer_placement(groups)[6] == (
        2,
        2,
    )  # in layer order, 3 at a time
    assert kv_cache_groups([], 4) == [KVCacheGroup(None, (0, 1, 2, 3))]
    assert kv_cache_groups([4096] * 4, 4) == [KVCacheGroup(4096, (0, 1, 2, 3))]
    with pytest.raises(ValueError, match="entries"):
        kv_cache_groups([0, 512], 3)


def test_a_long_request_holds_a_window_of_blocks_in_window_groups():
    kv, baseline = manager(300), manager(300, free_out_of_window=False)
    prompt = list(range(100))
    runs = [(kv, request("a", prompt)), (baseline, request("a", prompt))]
    for m, r in runs:
        prefill(m, r, chunk=32)
    for _ in range(10):  # 1100 tokens in all, checked as they grow
        for m, r in runs:
            decode(m, r, 100)
        r = runs[0][1]
        full, *windows = held(kv, r)
        assert full == -(-r.num_tokens // BLOCK)  # full attention keeps everything
        assert all(w <= WINDOW // BLOCK + 1 for w in windows), windows  # bounded by the window
        assert held(baseline, runs[1][1]) == [full] * 3
    assert kv.num_free_blocks - baseline.num_free_blocks == 2 * (full - WINDOW // BLOCK - 1)
    ids = kv.get_group_block_ids("a")[0]
    assert ids[:60] == [0] * 60 and 0 not in ids[-5:]  # released entries read as the null block
    for m, r in runs:
        m.free(r)
        assert m.all_blocks_free()


def test_chunked_prefill_releases_blocks_behind_the_window_as_it_goes():
    kv = manager()
    r = request("a", list(range(320)))
    hits, _ = kv.get_computed_blocks(r)
    kv.allocate_slots(r, 32, 0, hits)
    r.num_computed_tokens = 32
    for _ in range(9):
        assert kv.allocate_slots(r, 32) is not None
        r.num_computed_tokens += 32
        # The chunk being computed reads from num_computed - 63 on: those blocks stay.
        first_needed = (r.num_computed_tokens - 32 - WINDOW + 1) // BLOCK
        for table in kv.tables[1:]:
            assert all(b.is_null for b in table["a"][: max(first_needed, 0)])
            assert not any(b.is_null for b in table["a"][max(first_needed, 0) :])


def test_prefix_hit_uses_the_window_blocks_it_needs_only():
    kv = manager()
    a = request("a", list(range(160)))  # 10 full blocks
    prefill(kv, a, chunk=64)
    decode(kv, a, 1)  # the window groups drop blocks 0..5 (they stay cached, in the free queue)
    # Evict every free block, the released window blocks included.
    kv.block_pool.free_blocks(kv.block_pool.get_new_blocks(kv.num_free_blocks))
    b = request("b", list(range(160)) + [999] * 20)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 160  # the window groups still hold blocks 6..9, all the next token reads
    for group_hits in hits.groups[1:]:
        assert [blk.is_null for blk in group_hits] == [True] * 6 + [False] * 4
    assert [blk.block_id for blk in hits.groups[0]] == kv.get_block_ids("a")[:10]
    assert kv.allocate_slots(b, 20, num_hit, hits) is not None
    b.num_computed_tokens = 180
    # A prompt ending earlier would need evicted window blocks: no hit at all, though the
    # full-attention group has all of them.
    c = request("c", list(range(128)) + [555] * 10)
    assert kv.get_computed_blocks(c)[1] == 0
    for r in (a, b):
        kv.free(r)
    assert kv.all_blocks_free()


def test_hit_blocks_are_per_group():
    """The same tokens in two groups are two cache entries: a hit never hands group 1 a block of group 0."""
    kv = manager()
    a = request("a", list(range(48)))
    prefill(kv, a)
    kv.free(a)
    hits, num_hit = kv.get_computed_blocks(request("b", list(range(48)) + [1]))
    assert num_hit == 48
    ids = [[blk.block_id for blk in g] for g in hits.groups]
    assert len({i for g in ids for i in g}) == 9  # 3 blocks per group, all distinct


def test_a_short_pool_refuses_and_preemption_frees_every_group():
    kv = manager(num_blocks=30)  # 29 usable: a 100-token request needs 7 per group, 21 in all
    a = request("a", list(range(100)))
    prefill(kv, a)
    b = request("b", list(range(500, 600)))
    hits, _ = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 100, 0, hits) is None
    assert "b" not in kv.tables[1]
    kv.free(a)  # what preemption does
    assert kv.all_blocks_free()
    assert kv.allocate_slots(b, 100, 0, kv.get_computed_blocks(b)[0]) is not None


def test_new_blocks_never_take_another_groups_hit_from_the_free_queue():
    """Hits of every group leave the free queue before any group allocates: a revived hit of
    group 1 handed out as a new block of group 0 would be overwritten while group 1 reads it."""
    kv = manager(num_blocks=16)  # 15 usable
    a = request("a", list(range(48)))
    prefill(kv, a)  # 3 blocks per group, 9 in all
    c = request("c", list(range(500, 532)))
    prefill(kv, c)  # the other 6
    kv.free(a)
    kv.free(c)  # free queue: a's blocks (group 0, 1, 2), then c's
    b = request("b", list(range(48)) + list(range(100, 116)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 48
    assert kv.allocate_slots(b, 16, num_hit, hits) is not None  # one new block per group
    tables = [[blk.block_id for blk in t["b"]] for t in kv.tables]
    everything = [i for t in tables for i in t]
    assert len(everything) == len(set(everything)) == 12, tables  # no block in two places
