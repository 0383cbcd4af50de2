"""KV cache events describe the cache exactly: a subscriber that applies every
event in order holds the pool's set of cached block hashes after every step,
through random workloads with shared prefixes, eviction, preemption, aborts
and prefix cache resets (scheduler + FakeWorker, several seeds).
"""

from __future__ import annotations

import random

import pytest

from protocol.block_hashes import hash_block_tokens
from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from services.engine_core.request import RequestStatus
from tests.engine_core.fakes import FakeWorker, make_request, make_scheduler, step

BLOCK = 16


class Subscriber:
    """Applies events to a set of hashes, checking each event against that state."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()
        self.counts = {"stored": 0, "removed": 0, "cleared": 0}

    def apply(self, events) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.hashes, "removed a hash never stored"
                self.hashes.difference_update(event.block_hashes)
                self.counts["removed"] += 1
            else:
                assert isinstance(event, AllBlocksCleared)
                self.hashes.clear()
                self.counts["cleared"] += 1

    def _stored(self, event: BlockStored) -> None:
        assert event.block_size == BLOCK and event.medium == "CPU"
        assert len(event.token_ids) == BLOCK * len(event.block_hashes)
        assert not self.hashes & set(event.block_hashes), "a hash stored twice"
        # A block's parent is still cached when the block is stored (its request holds it).
        assert event.parent_block_hash is None or event.parent_block_hash in self.hashes
        parent = event.parent_block_hash
        for i, block_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[i * BLOCK : (i + 1) * BLOCK]
            if parent is not None:  # the first block of a salted prompt also hashes the salt
                assert hash_block_tokens(parent, tokens) == block_hash, "tokens do not match the hash"
            parent = block_hash
        self.hashes.update(event.block_hashes)
        self.counts["stored"] += 1


def _scheduler(rng: random.Random):
    s = make_scheduler(
        num_blocks=rng.randint(8, 14),
        max_model_len=96,
        block_size=BLOCK,
        max_num_batched_tokens=rng.choice([32, 64, 128]),
        max_num_seqs=rng.randint(2, 5),
    )
    s.kv_cache_manager.block_pool.enable_kv_events(BLOCK, "CPU")
    return s


def _prompt(rng: random.Random, index: int) -> list[int]:
    base = rng.randint(0, 2)  # requests of one base share a prefix of whole blocks and more
    shared = [base * 1000 + j for j in range(rng.randint(0, 48))]
    return shared + [50_000 + index * 100 + j for j in range(rng.randint(1, 20))]


SEEDS = range(8)


def _run_workload(seed: int) -> tuple[Subscriber, int, int]:
    """A random workload, checking the subscriber against the pool after every step;
    returns (subscriber, preemptions, resets)."""
    rng = random.Random(seed)
    s, worker, subscriber = _scheduler(rng), FakeWorker(BLOCK), Subscriber()
    pool = s.kv_cache_manager.block_pool
    live: list[str] = []
    preemptions = resets = 0
    for index in range(60):
        request = make_request(
            s,
            f"r{index}",
            _prompt(rng, index),
            max_tokens=rng.randint(1, 20),
            cache_salt=rng.choice([None, None, "salt"]),
        )
        s.add_request(request)
        live.append(request.request_id)
        if rng.random() < 0.1:
            s.finish_requests(live.pop(rng.randrange(len(live))), RequestStatus.FINISHED_ABORTED)
        for _ in range(rng.randint(0, 6)):
            if s.has_unfinished_requests():
                so, _ = step(s, worker)
                preemptions += len(so.preempted_req_ids)
            subscriber.apply(pool.take_kv_events())
            assert subscriber.hashes == set(pool.cached_blocks)
        if rng.random() < 0.15:
            _drain(s, worker, subscriber)
            assert s.kv_cache_manager.reset_prefix_cache()
            resets += 1
            subscriber.apply(pool.take_kv_events())
            assert subscriber.hashes == set(pool.cached_blocks) == set()
    _drain(s, worker, subscriber)
    assert s.kv_cache_manager.all_blocks_free()
    return subscriber, preemptions, resets


@pytest.mark.parametrize("seed", SEEDS)
def test_event_stream_equals_pool_state_under_random_workloads(seed):
    subscriber, _, _ = _run_workload(seed)
    # Hashes came and went (evictions), not only came.
    assert subscriber.counts["stored"] and subscriber.counts["removed"]


def _drain(s, worker, subscriber) -> None:
    pool = s.kv_cache_manager.block_pool
    for _ in range(2000):
        if not s.has_unfinished_requests():
            return
        step(s, worker)
        subscriber.apply(pool.take_kv_events())
        assert subscriber.hashes == set(pool.cached_blocks)
    raise AssertionError("requests did not finish")


def test_the_seeds_reach_preemption_and_reset():
    """The seeds are fixed: this guards against a workload change that skips the hard paths."""
    runs = [_run_workload(seed) for seed in SEEDS]
    assert sum(preemptions for _, preemptions, _ in runs) > 0, "no seed preempted"
    assert sum(resets for _, _, resets in runs) > 0, "no seed reset the prefix cache"
    assert sum(sub.counts["cleared"] for sub, _, _ in runs) > 0


def test_a_hash_held_by_two_blocks_is_stored_once_and_removed_with_its_last_block():
    s = make_scheduler(num_blocks=16, max_model_len=96, block_size=BLOCK)
    pool = s.kv_cache_manager.block_pool
    pool.enable_kv_events(BLOCK, "CPU")
    prompt = list(range(100, 100 + 2 * BLOCK + 3))
    # Two requests that filled the same prefix at once: two blocks per hash.
    copies = []
    for name in ("a", "b"):
        request = make_request(s, name, prompt)
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(request, blocks, 0, 2)
        copies.append(blocks)
    stored = pool.take_kv_events()
    assert len(stored) == 1 and isinstance(stored[0], BlockStored)
    assert stored[0].parent_block_hash is None and len(stored[0].block_hashes) == 2
    assert stored[0].token_ids == prompt[: 2 * BLOCK]
    for block in copies[0]:
        pool.uncache_block(block)
    assert pool.take_kv_events() == [], "the hashes are still cached (the other copies)"
    for block in copies[1]:
        pool.uncache_block(block)
    assert pool.take_kv_events() == [BlockRemoved([h], "CPU") for h in stored[0].block_hashes]
    assert not pool.cached_blocks


def test_no_events_are_recorded_unless_enabled():
    s = make_scheduler(num_blocks=16, max_model_len=96, block_size=BLOCK)
    pool = s.kv_cache_manager.block_pool
    request = make_request(s, "a", list(range(2 * BLOCK)))
    pool.cache_full_blocks(request, pool.get_new_blocks(2), 0, 2)
    assert pool.kv_events is None and pool.take_kv_events() == []
