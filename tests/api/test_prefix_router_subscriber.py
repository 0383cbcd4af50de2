"""The API's per-rank subscriber against a real (in-process) publisher: a view
built from replay when it joins late, gaps closed by replay, garbage dropped."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from protocol.kv_events import BlockRemoved, BlockStored, KVEventBatch, KVEventsConfig
from protocol.zmq_sockets import ipc_address
from services.api.prefix_router import RankCacheView, RankSubscriber
from services.engine_core.kv_events import ZmqEventPublisher
from tests.polling import wait_until

pytestmark = pytest.mark.asyncio

BLOCK = 16


def _stored(i: int) -> list:
    return [BlockStored([bytes([i]) * 32], None, [i] * BLOCK, BLOCK, "CPU")]


@pytest.fixture
def config():
    return KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=ipc_address("kv"),
        replay_endpoint=ipc_address("kvr"),
        topic="k",
    )


@pytest.fixture
def publisher(config):
    pub = ZmqEventPublisher(config, rank=1)  # rank 1: the _dp1 endpoints, as the subscriber derives them
    yield pub
    pub.shutdown()


@pytest.fixture
async def ctx():
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def test_a_late_subscriber_builds_its_view_from_replay_then_follows_live(config, publisher, ctx):
    for i in range(5):
        publisher.publish(_stored(i))
    publisher.publish([BlockRemoved([bytes([2]) * 32])])
    # Joining before the publisher thread sent them all would leave the rest to the next
    # batch's gap check; here the subscriber joins after all six, as a late one does.
    await wait_until(lambda: publisher.num_sent == 6, 10, "the publisher to send six batches")
    view = RankCacheView()
    subscriber = RankSubscriber(ctx, config, 1, view)
    task = asyncio.create_task(subscriber.run())
    try:
        await wait_until(lambda: subscriber.next_seq == 6, 10, "the replay")
        assert len(view) == 4 and bytes([2]) * 32 not in view and bytes([4]) * 32 in view
        # Live batches follow (the SUB socket may need a moment to join: any it misses come by replay).
        for i in range(5, 8):
            publisher.publish(_stored(i))
        await wait_until(lambda: subscriber.next_seq == 9, 10, "the live batches")
        assert len(view) == 7
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_gap_is_closed_by_replay_and_garbage_is_dropped(config, publisher, ctx):
    view = RankCacheView()
    subscriber = RankSubscriber(ctx, config, 1, view)
    publisher.publish(_stored(0))
    await subscriber._replay()
    assert subscriber.next_seq == 1
    for i in range(1, 4):  # published while the subscriber was not listening
        publisher.publish(_stored(i))
    await wait_until(lambda: publisher._next_seq == 4, 10, "the publisher to send")
    # A live message with seq 4 arrives: 1..3 are missing, and replay brings them first.
    await subscriber._on_message([b"k", (4).to_bytes(8, "big"), _encoded(_stored(4))])
    assert subscriber.next_seq == 5 and len(view) == 5 and subscriber.num_replays == 2
    await subscriber._on_message([b"k", b"short", b""])
    await subscriber._on_message([b"k", (5).to_bytes(8, "big"), b"\xc1 not msgpack"])
    assert subscriber.num_dropped == 2 and subscriber.next_seq == 5
    # An old (already applied) seq changes nothing.
    await subscriber._on_message([b"k", (0).to_bytes(8, "big"), _encoded([BlockRemoved([bytes([0]) * 32])])])
    assert bytes([0]) * 32 in view


def _encoded(events: list) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events))
