"""Prefix-aware routing over two real engine-core processes (a tiny random Llama).

One stack for the module: two local ranks publishing KV cache events on
ipc, a DPLBEngineClient with a PrefixRouter that restarts a killed rank,
every link (the events too) under one ``weft keys`` folder (CurveZMQ).
An external subscriber (plain pyzmq + msgspec Structs of its own, holding
the server key) reads the same events. Every process is killed in a fixture.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import pytest_asyncio
import zmq

from protocol import EngineCoreRequest, FinishReason, SamplingParams
from protocol.block_hashes import prompt_block_hashes
from protocol.curve import CLIENT, SERVER, CurveKeys, generate_keys, load_keys
from protocol.kv_events import KVEventsConfig
from protocol.zmq_sockets import ipc_address
from services.api.dp_client import DPLBEngineClient, launch_local_engines
from services.api.prefix_router import PrefixRouter
from tests.api.dp_requests import collect
from tests.polling import wait_until
from tests.tiny_model import build_tiny_llama, tiny_engine_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

NUM_BLOCKS = 64
BLOCK = 16
START_S = 90.0  # engine start-up on two busy cores
EVENTS_S = 10.0


@pytest.fixture(scope="module")
def events_config() -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=ipc_address("kv"),
        replay_endpoint=ipc_address("kvr"),
        topic="weft",
        include_token_ids=True,  # the external subscriber below reads the blocks' tokens
    )


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory, events_config):
    config = tiny_engine_config(build_tiny_llama(tmp_path_factory.mktemp("tiny")), NUM_BLOCKS)
    return msgspec.structs.replace(config, kv_events=events_config)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys") / "keys"
    generate_keys(folder)
    return folder


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tiny_config, keys):
    address = ipc_address("hs")
    processes = launch_local_engines(2, 0, address, num_threads=1, curve_keys=str(keys))
    client = DPLBEngineClient(
        tiny_config,
        address,
        2,
        processes,
        restart_local=True,
        prefix_router=PrefixRouter(tiny_config),
        curve=load_keys(keys, SERVER),
    )
    try:
        await client.start()
        await wait_until(lambda: client.ready, START_S, "both ranks to be ready")
        yield client
    finally:
        await client.shutdown()
        for proc in client.local.processes.values():
            proc.kill()
            proc.wait()


def _prompt(first: int, num_blocks: int, tail: int) -> list[int]:
    return list(range(first, first + num_blocks * BLOCK)) + list(range(20_000 + tail, 20_000 + tail + 5))


def _request(
    request_id: str, prompt: list[int], max_tokens: int = 4, rank: int | None = None
) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        arrival_time=0.0,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        data_parallel_rank=rank,
    )


async def _warm(client: DPLBEngineClient, rank: int, prompt: list[int], request_id: str) -> None:
    """Run ``prompt`` on ``rank`` and wait until the router's view of it holds the prompt's blocks."""
    await collect(client, _request(request_id, prompt, rank=rank))
    hashes = prompt_block_hashes(prompt, BLOCK)
    router = client.prefix_router
    await wait_until(
        lambda: rank in router.views and router.views[rank].hit_blocks(hashes) == len(hashes),
        EVENTS_S,
        f"rank {rank}'s events for {request_id}",
    )


async def test_a_prefix_cached_on_rank_1_is_routed_to_rank_1_and_hits(client):
    await _warm(client, 1, _prompt(1000, 3, tail=0), "warm-a")
    routed = client.rank_stats()[1].num_routed
    tokens, last = await collect(client, _request("follow-a", _prompt(1000, 3, tail=50)))
    # Both ranks are idle: load alone would pick rank 0 (ties go to the lowest rank).
    assert client.rank_stats()[1].num_routed == routed + 1
    assert last.finish_reason == FinishReason.LENGTH and len(tokens) == 4
    assert last.num_cached_tokens >= 3 * BLOCK


async def test_a_flood_on_one_hot_prefix_spreads_once_the_holder_is_loaded_beyond_the_bound(client):
    await _warm(client, 1, _prompt(3000, 3, tail=0), "warm-b")
    before = {rank: s.num_routed for rank, s in client.rank_stats().items()}
    generators = [
        client.generate(_request(f"flood-{i}", _prompt(3000, 3, tail=100 + 10 * i), max_tokens=24))
        for i in range(10)
    ]
    await asyncio.gather(*(anext(g) for g in generators))  # each is routed before its first output
    routed = {rank: s.num_routed - before[rank] for rank, s in client.rank_stats().items()}
    for gen in generators:
        async for _ in gen:
            pass
    assert routed[0] + routed[1] == 10
    assert routed[0] >= 2, f"rank 0 idled while rank 1 took the flood: {routed}"
    assert routed[1] > routed[0], f"the prefix did not weigh at all: {routed}"


async def test_a_killed_ranks_view_is_dropped_and_its_restarted_process_is_routed_to_again(client):
    await _warm(client, 1, _prompt(5000, 3, tail=0), "warm-c")
    router = client.prefix_router
    old = client.local.processes[1]
    old.kill()
    await wait_until(lambda: client.rank_stats()[1].state == "dead", START_S, "rank 1 to be seen dead")
    assert 1 not in router.views
    # Meanwhile its prefix is routed by load, to the live rank.
    _, last = await collect(client, _request("while-dead", _prompt(5000, 3, tail=7)))
    assert last.finish_reason == FinishReason.LENGTH
    await wait_until(
        lambda: client.rank_stats()[1].state == "ready" and client.local.processes[1] is not old,
        START_S,
        "rank 1 to be restarted and ready",
    )
    # The new process's cache is empty, and so is its view: nothing of the old one came back.
    assert router.views[1].hit_blocks(prompt_block_hashes(_prompt(5000, 3, tail=0), BLOCK)) == 0
    await _warm(client, 1, _prompt(7000, 3, tail=0), "warm-d")
    routed = client.rank_stats()[1].num_routed
    _, last = await collect(client, _request("follow-d", _prompt(7000, 3, tail=9)))
    assert client.rank_stats()[1].num_routed == routed + 1
    assert last.num_cached_tokens >= 3 * BLOCK


# An external subscriber's own view of the wire: nothing of weft's code.
class _Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: str | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


async def test_an_external_pyzmq_subscriber_receives_a_real_engines_events(client, events_config, keys):
    ctx = zmq.Context()
    # The engines' event sockets let in the holder of the server key, talking to the engine's key.
    api = load_keys(keys, SERVER)
    router_keys = CurveKeys(CLIENT, api.public, api.secret, load_keys(keys, CLIENT).public)
    sub = ctx.socket(zmq.SUB)
    router_keys.apply(sub)
    sub.setsockopt(zmq.SUBSCRIBE, b"weft")
    sub.connect(events_config.endpoint)  # rank 0 binds the endpoint as given
    replay = ctx.socket(zmq.DEALER)
    router_keys.apply(replay)
    replay.connect(events_config.replay_endpoint)
    decoder = msgspec.msgpack.Decoder(_Batch)
    prompt = _prompt(9000, 2, tail=0)
    try:
        await collect(client, _request("external", prompt, rank=0))
        # Whatever the SUB missed while connecting, the replay socket has: ask from seq 0.
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        batches = []
        while True:
            assert await asyncio.to_thread(replay.poll, 10_000), "no replay answer"
            _, seq, payload = replay.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            batches.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
        seqs = [seq for seq, _ in batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "replayed batches are in order, no gap"
        stored = [e for _, b in batches for e in b.events if isinstance(e, _Stored)]
        ours = [e for e in stored if e.token_ids[:BLOCK] == prompt[:BLOCK]]
        assert ours and ours[0].block_hashes == prompt_block_hashes(prompt, BLOCK)
        assert ours[0].token_ids == prompt[: 2 * BLOCK] and ours[0].block_size == BLOCK
        assert all(b.data_parallel_rank == 0 for _, b in batches)
        # Live: a new step's batch reaches the SUB socket with the next seq.
        await collect(client, _request("external-2", _prompt(9500, 1, tail=0), rank=0))
        live = []
        while not live or live[-1][0] <= seqs[-1]:  # earlier batches may come first
            assert await asyncio.to_thread(sub.poll, 10_000), f"no live event after seq {seqs[-1]}: {live}"
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"weft"
            live.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
        assert live[-1][1].events
    finally:
        sub.close(0)
        replay.close(0)
        ctx.term()
