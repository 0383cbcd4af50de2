"""The prefix-aware rule, the per-rank views and the API-side hashing, in process."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from protocol import EngineCoreRequest, SamplingParams
from protocol.block_hashes import prompt_block_hashes
from protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
)
from services.api.prefix_router import (
    PrefixRouter,
    RankCacheView,
    choose_rank,
    session_key_of,
)
from services.engine_core.prefix_hash import make_block_hasher
from services.engine_core.request import Request
from tests.api.fake_engine_client import engine_config

BLOCK = 16


def _view(hashes: list[bytes], max_hashes: int = 1000) -> RankCacheView:
    view = RankCacheView(max_hashes)
    view.apply(KVEventBatch(ts=0.0, events=[BlockStored(hashes, None, [0] * BLOCK * len(hashes), BLOCK)]))
    return view


def test_api_hashes_equal_the_engines_for_plain_and_salted_prompts():
    prompt = list(range(1000, 1000 + 3 * BLOCK + 5))
    for salt in (None, "tenant-a"):
        request = Request(
            "r",
            prompt,
            SamplingParams(max_tokens=1),
            0.0,
            cache_salt=salt,
            block_hasher=make_block_hasher(BLOCK),
        )
        assert prompt_block_hashes(prompt, BLOCK, salt) == request.block_hashes
        assert len(request.block_hashes) == 3
    assert prompt_block_hashes(prompt, BLOCK, None) != prompt_block_hashes(prompt, BLOCK, "tenant-a")
    assert prompt_block_hashes(prompt, BLOCK, max_blocks=2) == prompt_block_hashes(prompt, BLOCK)[:2]


def test_view_follows_stored_removed_cleared_and_counts_the_leading_hits():
    hashes = prompt_block_hashes(list(range(4 * BLOCK)), BLOCK)
    view = _view(hashes[:3])
    assert view.hit_blocks(hashes) == 3
    view.apply(KVEventBatch(ts=0.0, events=[BlockRemoved([hashes[1]])]))
    assert view.hit_blocks(hashes) == 1, "a missing middle block ends the prefix"
    view.apply(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
    assert len(view) == 0 and view.hit_blocks(hashes) == 0


def test_view_memory_is_capped_by_forgetting_the_oldest_hashes():
    hashes = prompt_block_hashes(list(range(10 * BLOCK)), BLOCK)
    view = _view(hashes, max_hashes=4)
    assert len(view) == 4
    assert hashes[0] not in view and hashes[-1] in view


def test_the_longest_cached_prefix_wins_within_the_load_bound():
    assert choose_rank({0: 0, 1: 0}, {0: 1, 1: 3}) == 1
    assert choose_rank({0: 0, 1: 8}, {1: 3}, max_imbalance=8) == 1, "at the bound the hit still counts"


def test_a_rank_loaded_beyond_the_bound_loses_its_hit():
    assert choose_rank({0: 0, 1: 9}, {1: 3}, max_imbalance=8) == 0
    # The next best hit among the candidates wins then.
    assert choose_rank({0: 0, 1: 20, 2: 4}, {1: 5, 2: 2}, max_imbalance=8) == 2


def test_equal_hits_go_to_the_lower_load_then_the_lower_rank():
    assert choose_rank({0: 5, 1: 1}, {0: 2, 1: 2}) == 1
    assert choose_rank({0: 1, 1: 1}, {0: 2, 1: 2}) == 0


def test_without_hits_or_session_the_least_loaded_rank_is_chosen():
    assert choose_rank({0: 4, 1: 1, 2: 1}, {}) == 1


def test_sessions_stick_to_one_rank_and_spread_over_ranks():
    loads = {0: 0, 1: 0, 2: 0}
    picks = {key: choose_rank(loads, {}, key) for key in (f"user-{i}" for i in range(60))}
    assert all(choose_rank(loads, {}, key) == rank for key, rank in picks.items())
    assert set(picks.values()) == {0, 1, 2}
    # Rendezvous hashing: dropping rank 2 moves only the sessions that were on it.
    without_2 = {key: choose_rank({0: 0, 1: 0}, {}, key) for key in picks}
    assert all(without_2[key] == rank for key, rank in picks.items() if rank != 2)
    # A cached prefix elsewhere beats the session's rank.
    key = next(k for k, r in picks.items() if r == 0)
    assert choose_rank(loads, {1: 1}, key) == 1


def test_session_key_prefers_the_header_and_refuses_a_huge_one():
    assert session_key_of("abc", "user") == "abc"
    assert session_key_of(None, "user") == "user"
    assert session_key_of("", None) is None
    with pytest.raises(ValueError, match="x-session-id or user"):
        session_key_of("x" * 257, None)


def test_choose_rank_needs_a_rank():
    with pytest.raises(ValueError):
        choose_rank({}, {})


def test_the_router_and_hashing_import_without_torch():
    code = (
        "import sys, services.api.prefix_router, services.api.dp_client; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _router(views: dict[int, RankCacheView]) -> PrefixRouter:
    config = msgspec.structs.replace(
        engine_config(),
        kv_events=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="ipc:///nowhere/kv"),
    )
    router = PrefixRouter(config, max_imbalance=8)
    router.views.update(views)
    return router


def _engine_request(
    prompt: list[int], salt: str | None = None, session: str | None = None
) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id="r",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=1),
        arrival_time=0.0,
        cache_salt=salt,
        session_key=session,
    )


def test_the_router_hashes_prompts_as_the_engine_does_salt_included():
    prompt = list(range(500, 500 + 3 * BLOCK + 1))
    router = _router({0: _view([]), 1: _view(prompt_block_hashes(prompt, BLOCK, "s"))})
    assert router.pick(_engine_request(prompt, salt="s"), {0: 0, 1: 0}) == 1
    assert router.pick(_engine_request(prompt), {0: 0, 1: 0}) == 0, "another salt is another cache"
    assert router.pick(_engine_request(prompt, salt="s"), {0: 0, 1: 9}) == 0, "beyond the bound"
    assert router.pick(_engine_request(prompt, salt="s"), {0: 0}) == 0, "only ready ranks count"


def test_the_last_prompt_token_is_never_counted_as_a_hit():
    # A prompt of exactly three blocks can hit two at most: the engine computes the last token.
    prompt = list(range(700, 700 + 3 * BLOCK))
    hashes = prompt_block_hashes(prompt, BLOCK)
    router = _router({0: _view(hashes[:2]), 1: _view(hashes)})
    assert router.pick(_engine_request(prompt), {0: 0, 1: 0}) == 0, "equal useful hits: the lower rank"


def test_prefix_routing_needs_published_events():
    with pytest.raises(ValueError, match="kv-events-config"):
        PrefixRouter(engine_config())
