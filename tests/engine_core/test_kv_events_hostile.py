"""Issue 44 #1: the KV-event stream under attack, against the real publisher
(in process, no model). Before: ``tcp://*:5557`` on every interface, no
CURVE, prompts in plaintext, the whole replay buffer to anyone, and a
512 MiB frame to the replay socket raised the engine's peak memory by 1 GB."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from protocol.curve import SERVER, CurveKeys, generate_keys, load_keys
from protocol.kv_events import (
    END_OF_REPLAY,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    connect_address,
)
from protocol.zmq_sockets import ipc_address
from services.api.prefix_router import PrefixRouter, RankCacheView, RankSubscriber
from services.config.kv_events_args import resolve_kv_events_config
from services.engine_core import kv_events
from services.engine_core.kv_events import ZmqEventPublisher, make_publisher
from tests.engine_core.fakes import make_config
from tests.engine_core.test_kv_events_state import BLOCK, make_request, make_scheduler
from tests.polling import wait_for

DECODER = msgspec.msgpack.Decoder(KVEventBatch)
ON = '"enable_kv_cache_events": true, "publisher": "zmq"'


def _stored(i: int) -> list:
    return [BlockStored([bytes([i]) * 32], None, [], 16, "CPU")]


def test_defaults_bind_loopback_and_an_exposed_endpoint_needs_curve():
    assert resolve_kv_events_config("{" + ON + "}").endpoint == "tcp://127.0.0.1:5557"
    for endpoint in ("tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://10.1.2.3:5557"):
        value = "{" + ON + f', "endpoint": "{endpoint}"' + "}"
        with pytest.raises(ValueError, match="needs CurveZMQ"):
            resolve_kv_events_config(value, has_keys=False)  # weft serve without --zmq-curve-keys
        config = resolve_kv_events_config(value)  # the engine's own check, keys or not, comes later
        with pytest.raises(ValueError, match="needs CurveZMQ"):
            make_publisher(config, 0)  # an engine without a keys folder binds nothing
    assert resolve_kv_events_config("{" + ON + ', "endpoint": "tcp://*:5557"}', has_keys=True)


def test_the_two_rank_example_no_longer_collides():
    """Before: endpoint 5557 and replay 5558 with two ranks: rank 1's PUB took rank 0's
    replay port ("Address already in use"). Now refused at start, with a fix."""
    value = "{" + ON + ', "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}'
    assert resolve_kv_events_config(value, 1) is not None
    with pytest.raises(ValueError, match="overlap"):
        resolve_kv_events_config(value, 2)
    apart = "{" + ON + ', "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5657"}'
    assert resolve_kv_events_config(apart, 64) is not None


def test_remote_ranks_are_subscribed_at_their_own_host():
    assert connect_address("tcp://*:5558", "10.0.0.7") == "tcp://10.0.0.7:5558"
    assert connect_address("tcp://0.0.0.0:5558", "fd00::7") == "tcp://[fd00::7]:5558"
    assert connect_address("tcp://127.0.0.1:5558", "10.0.0.7") == "tcp://127.0.0.1:5558"
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:6000")
    router = PrefixRouter(msgspec.structs.replace(make_config(), kv_events=events))
    ctx = zmq.asyncio.Context()

    async def up() -> RankSubscriber:
        router.start(ctx)
        router.rank_up(3, host="10.0.0.7")
        subscriber = router.subscribers[3]
        await router.stop()
        return subscriber

    try:
        assert asyncio.run(up())._address == "tcp://10.0.0.7:6003"
    finally:
        ctx.destroy(linger=0)


def test_stored_events_carry_hashes_only_unless_asked():
    for token_ids, expected in ((False, 0), (True, 2 * BLOCK)):
        s = make_scheduler(num_blocks=16, max_model_len=96, block_size=BLOCK)
        pool = s.kv_cache_manager.block_pool
        pool.enable_kv_events(BLOCK, "CPU", token_ids=token_ids)
        prompt = list(range(100, 100 + 2 * BLOCK + 3))
        pool.cache_full_blocks(make_request(s, "a", prompt), pool.get_new_blocks(2), 0, 2)
        (stored,) = pool.take_kv_events()
        assert len(stored.token_ids) == expected and len(stored.block_hashes) == 2


@pytest.fixture
def keys(tmp_path):
    generate_keys(tmp_path / "keys")
    return tmp_path / "keys"


@pytest.fixture
def curved(keys):
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint="tcp://127.0.0.1:0",
        replay_endpoint="tcp://127.0.0.1:0",
        keys_dir=str(keys),
    )
    pub = ZmqEventPublisher(config, rank=0)
    for i in range(3):
        pub.publish(_stored(i))
    wait_for(lambda: pub.num_sent == 3, 10, "three batches sent")
    yield pub
    pub.shutdown()


def _ask_replay(sock: zmq.Socket, timeout_ms: int = 2000) -> list[int] | None:
    """The seqs of one replay answer; None when nothing came back. A DEALER with no connection up
    blocks on send (a peer the server's CURVE refuses keeps reconnecting and has none between
    tries), so the send is bounded too: not sent is nothing back."""
    sock.sndtimeo = timeout_ms
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
    except zmq.Again:
        return None
    seqs = []
    while sock.poll(timeout_ms):
        _, seq, _ = sock.recv_multipart()
        if seq == END_OF_REPLAY:
            return seqs
        seqs.append(int.from_bytes(seq, "big"))
    return None


def test_with_keys_only_the_apis_key_reads_the_stream(curved, keys):
    ctx = zmq.Context()
    try:
        api = load_keys(keys, SERVER)
        public, secret = zmq.curve_keypair()
        stranger = CurveKeys("client", public, secret, load_keys(keys, "client").public)
        for curve in (None, stranger):  # anonymous; CURVE with a key of its own
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            if curve is not None:
                curve.apply(sock)
            sock.connect(curved.replay_endpoint)
            assert _ask_replay(sock, 1000) is None, "an unauthenticated peer read the replay buffer"
            sock.close()
        wait_for(lambda: curved.auth.num_denied >= 1, 10, "the stranger to be refused")
        # What the API's PrefixRouter hands its subscribers: its server key (--zmq-curve-keys, or
        # the events' own keys_dir), the engine's client key.
        for keys_dir, api_keys in ((None, api), (str(keys), None)):
            events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", keys_dir=keys_dir)
            router = PrefixRouter(msgspec.structs.replace(make_config(), kv_events=events))
            router.start(ctx, api_keys)
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            router._subscriber_keys("client").apply(sock)
            sock.connect(curved.replay_endpoint)
            assert _ask_replay(sock) == [0, 1, 2]
            sock.close()
    finally:
        ctx.destroy(linger=0)


def test_a_huge_frame_to_the_replay_socket_disconnects_its_sender(curved, keys, monkeypatch):
    """A peer's frame over 1 KiB (a replay request is 8 bytes) is refused as it arrives: the
    publisher never holds it and keeps answering."""
    ctx = zmq.Context()
    try:
        api = load_keys(keys, SERVER)
        client_keys = CurveKeys("client", api.public, api.secret, load_keys(keys, "client").public)
        big = ctx.socket(zmq.DEALER)
        big.linger = 0
        client_keys.apply(big)
        big.connect(curved.replay_endpoint)
        big.send_multipart([b"", b"\0" * (8 << 20)])
        assert not big.poll(1000), "an oversized request got an answer"
        honest = ctx.socket(zmq.DEALER)
        honest.linger = 0
        client_keys.apply(honest)
        honest.connect(curved.replay_endpoint)
        assert _ask_replay(honest) == [0, 1, 2]
        assert curved.num_replays_refused == 0  # never even reached the publisher
        big.close()
        honest.close()
    finally:
        ctx.destroy(linger=0)


def test_replay_is_rate_and_size_limited(monkeypatch):
    monkeypatch.setattr(kv_events, "MAX_REPLAY_BATCHES", 5)
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=ipc_address("pub"),
        replay_endpoint=ipc_address("replay"),
    )
    pub = ZmqEventPublisher(config, rank=0)
    ctx = zmq.Context()
    try:
        for i in range(20):
            pub.publish(_stored(i))
        wait_for(lambda: pub.num_sent == 20, 10, "twenty batches sent")
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(pub.replay_endpoint)
        assert _ask_replay(sock) == [0, 1, 2, 3, 4]  # at most MAX_REPLAY_BATCHES per answer
        # A flood of requests: past the burst, empty answers at once (counted), not the buffer.
        answers = [_ask_replay(sock) for _ in range(3 * kv_events.REPLAY_BURST)]
        assert [] in answers and pub.num_replays_refused > 0
        assert sum(len(a) for a in answers) <= 5 * (kv_events.REPLAY_BURST + 2)
        # A subscriber is not stuck on a partial answer: it asks on from where it got to.
        view = RankCacheView()
        actx = zmq.asyncio.Context()
        subscriber = RankSubscriber(actx, config, 0, view)
        subscriber.next_seq = 15
        asyncio.run(subscriber._replay())
        actx.destroy(linger=0)
        assert subscriber.next_seq in (15, 20)  # refused (over the rate) or the last five
        sock.close()
    finally:
        pub.shutdown()
        ctx.destroy(linger=0)
