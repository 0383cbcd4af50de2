"""The engine core's KV event publisher in process: PUB framing, replay from a bounded ring buffer,
per-rank endpoints, and the config as users give it."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from protocol.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    KVEventBatch,
    KVEventsConfig,
    endpoint_for_rank,
)
from protocol.zmq_sockets import ipc_address
from services.config.kv_events_args import resolve_kv_events_config
from services.engine_core.kv_events import ZmqEventPublisher
from tests.polling import wait_for

pytestmark = pytest.mark.slow

DECODER = msgspec.msgpack.Decoder(KVEventBatch)


@pytest.fixture
def publisher():
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=ipc_address("pub"),
        replay_endpoint=ipc_address("replay"),
        buffer_steps=3,
        topic="t",
    )
    pub = ZmqEventPublisher(config, rank=0)
    yield pub
    pub.shutdown()


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _replay(ctx, address: str, request: list[bytes]) -> list[tuple[int, KVEventBatch]]:
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    try:
        sock.send_multipart(request)
        got = []
        while True:
            assert sock.poll(10_000), "no replay answer"
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END_OF_REPLAY:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big", signed=True), DECODER.decode(payload)))
    finally:
        sock.close(0)


def _sent(publisher: ZmqEventPublisher, n: int) -> None:
    # publish() only queues: the publisher thread may serve a replay before it sends the rest.
    wait_for(lambda: publisher.num_sent == n, 10, f"{n} batches sent", interval_s=0.01)


def _removed(i: int) -> list:
    return [BlockRemoved([bytes([i]) * 32], "CPU")]


def test_replay_answers_from_seq_n_out_of_the_last_buffer_steps_batches(publisher, ctx):
    for i in range(5):
        publisher.publish(_removed(i))
    publisher.publish([])  # a step without events sends nothing
    _sent(publisher, 5)
    got = _replay(ctx, publisher.replay_endpoint, [b"", (3).to_bytes(8, "big")])
    assert [seq for seq, _ in got] == [3, 4]
    assert got[0][1].events == _removed(3) and got[0][1].data_parallel_rank == 0
    # Only the last three batches are kept: older ones are gone.
    assert [seq for seq, _ in _replay(ctx, publisher.replay_endpoint, [b"", (0).to_bytes(8, "big")])] == [
        2,
        3,
        4,
    ]


def test_a_malformed_replay_request_is_ignored_and_the_publisher_keeps_serving(publisher, ctx):
    bad = ctx.socket(zmq.DEALER)
    bad.connect(publisher.replay_endpoint)
    bad.send_multipart([b"", b"not eight bytes"])
    publisher.publish([AllBlocksCleared()])
    _sent(publisher, 1)
    got = _replay(ctx, publisher.replay_endpoint, [b"", (0).to_bytes(8, "big")])
    assert [b.events for _, b in got] == [[AllBlocksCleared()]]
    assert not bad.poll(100), "a malformed request got an answer"
    bad.close(0)


def test_subscribers_get_topic_seq_and_a_plain_msgpack_batch(publisher, ctx):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"t")
    sub.connect(publisher.endpoint)
    # A SUB socket misses what was sent before it joined: publish until one arrives.
    for i in range(200):
        publisher.publish(_removed(i % 256))
        if sub.poll(50):
            break
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"t" and len(seq) == 8
    assert msgspec.msgpack.decode(payload)["events"][0]["type"] == "BlockRemoved"  # self-describing tags
    sub.close(0)


def test_each_rank_binds_its_own_endpoint():
    assert endpoint_for_rank("tcp://*:5557", 0) == "tcp://*:5557"
    assert endpoint_for_rank("tcp://*:5557", 3) == "tcp://*:5560"
    assert endpoint_for_rank("ipc:///tmp/kv", 0) == "ipc:///tmp/kv"
    assert endpoint_for_rank("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"
    with pytest.raises(ValueError, match="port"):
        endpoint_for_rank("tcp://*", 1)
    with pytest.raises(ValueError, match="tcp://, ipc://"):
        endpoint_for_rank("udp://x:1", 0)


def test_kv_events_config_as_users_give_it():
    config = resolve_kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv"}')
    assert config.publishes and config.endpoint == "tcp://127.0.0.1:5557" and config.topic == "kv"
    assert config.buffer_steps == 10_000 and config.replay_endpoint is None
    assert resolve_kv_events_config(None) is None
    assert resolve_kv_events_config('{"enable_kv_cache_events": false}') is None
    for bad, match in (
        ("{nope", "not valid JSON"),
        ('{"enable_kv_cache_events": true, "colour": 1}', "colour"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
        ('{"enable_kv_cache_events": true, "endpoint": "tcp://*"}', "port"),
    ):
        with pytest.raises(ValueError, match=match):
            resolve_kv_events_config(bad)
