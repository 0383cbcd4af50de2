"""The kv_transfer service and its ZMQ client: put/get, waiting gets, LRU
under the memory cap, malformed frames, and a dead service."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import zmq

from protocol.kv_transfer import KVBlock
from protocol.zmq_sockets import make_socket, tcp_address
from services.kv_transfer.block_store import checksum, is_intact
from services.kv_transfer.service import KVTransferService, LRUBlockStore, entry_size
from services.kv_transfer.zmq_connector import ServiceDownError, ZmqBlockStore


def block(key: bytes, nbytes: int = 1024, fill: int | None = None) -> KVBlock:
    data = (
        np.full(nbytes, fill, np.uint8)
        if fill is not None
        else np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    )
    return KVBlock(key=key, dtype="float32", shape=[nbytes // 4], checksum=checksum(data), data=data)


class RunningService:
    def __init__(self, max_bytes: int = 1 << 20) -> None:
        self.service = KVTransferService(tcp_address("127.0.0.1", 0, bind=True), max_bytes)
        self.address = self.service.address
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.service.serve, args=(self.stop,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        assert not self.thread.is_alive()


@pytest.fixture
def service():
    running = RunningService()
    yield running
    running.close()


@pytest.fixture
def client(service):
    store = ZmqBlockStore(service.address, timeout_s=5.0)
    yield store
    store.close()


# ---- the store alone


def test_lru_store_evicts_the_least_recently_used_first():
    one = entry_size(block(b"a", 1000))
    store = LRUBlockStore(max_bytes=3 * one)
    for key in (b"a", b"b", b"c"):
        assert store.put(block(key, 1000))
    assert store.get(b"a") is not None  # a is now the most recent
    assert store.put(block(b"d", 1000))
    assert b"b" not in store and all(key in store for key in (b"a", b"c", b"d"))
    assert store.num_bytes == 3 * one and store.stats.num_evicted == 1


def test_lru_store_replaces_a_key_and_refuses_a_block_over_the_cap():
    store = LRUBlockStore(max_bytes=entry_size(block(b"a", 2000)))
    store.put(block(b"a", 1000, fill=1))
    store.put(block(b"a", 1500, fill=2))
    size = entry_size(block(b"a", 1500))
    assert len(store) == 1 and store.num_bytes == size and store.get(b"a").data[0] == 2
    assert not store.put(block(b"huge", 4000))
    assert b"huge" not in store and store.num_bytes == size
    with pytest.raises(ValueError, match="max_bytes"):
        LRUBlockStore(0)


# ---- over ZMQ


def test_put_then_get_returns_the_same_bytes(client):
    blocks = [block(b"k%d" % i, 4096, fill=i) for i in range(3)]
    client.put(blocks)
    found = client.get([b"k0", b"k1", b"k2", b"absent"], wait_s=0.0)
    assert set(found) == {b"k0", b"k1", b"k2"}
    for original in blocks:
        got = found[original.key]
        assert np.array_equal(got.data, original.data)
        assert is_intact(got, "float32", [1024])
    stats = client.stats()
    assert (stats.num_blocks, stats.num_bytes, stats.num_hits, stats.num_misses) == (
        3,
        sum(map(entry_size, blocks)),
        3,
        1,
    )


def test_a_get_waits_for_blocks_put_after_it(service, client):
    result = {}
    getter = threading.Thread(target=lambda: result.update(client.get([b"late"], wait_s=10.0)))
    getter.start()
    # The get is parked at the service before the block exists.
    while not service.service._parked:
        getter.join(0.01)
    producer = ZmqBlockStore(service.address, timeout_s=5.0)
    try:
        producer.put([block(b"late", 256, fill=7)])
    finally:
        producer.close()
    getter.join(timeout=10)
    assert not getter.is_alive() and result[b"late"].data[0] == 7


def test_a_get_returns_what_it_has_when_its_wait_ends(client):
    client.put([block(b"here", 256)])
    found = client.get([b"here", b"never"], wait_s=0.05)
    assert set(found) == {b"here"}


def test_memory_cap_evicts_blocks_for_new_ones():
    running = RunningService(max_bytes=2 * entry_size(block(b"a", 4096)))
    store = ZmqBlockStore(running.address, timeout_s=5.0)
    try:
        store.put([block(b"a", 4096), block(b"b", 4096)])
        store.put([block(b"c", 4096)])
        assert set(store.get([b"a", b"b", b"c"], 0.0)) == {b"b", b"c"}
        stats = store.stats()
        assert stats.num_evicted == 1 and stats.num_bytes <= stats.max_bytes
    finally:
        store.close()
        running.close()


def test_malformed_messages_are_dropped_and_the_service_keeps_serving(service, client):
    ctx = zmq.Context.instance()
    rogue = make_socket(ctx, zmq.DEALER, service.address, bind=False)
    try:
        rogue.send_multipart([b"\xc1 not msgpack"])
        rogue.send_multipart([b"\x93\x01\x02"])  # msgpack, but no request of ours
        client.put([block(b"ok", 256)])
        assert b"ok" in client.get([b"ok"], 0.0)
        assert service.service.num_dropped == 2
    finally:
        rogue.close(linger=0)


def test_a_dead_service_times_out_instead_of_hanging_then_fails_fast():
    running = RunningService()
    address = running.address
    running.close()
    store = ZmqBlockStore(address, timeout_s=0.2)
    other = ZmqBlockStore(address, timeout_s=30.0)  # another thread's client of the same service
    try:
        with pytest.raises(TimeoutError, match="did not answer"):
            store.get([b"x"], wait_s=0.1)
        # Known down now: no client waits for it again until the retry time.
        with pytest.raises(ServiceDownError):
            store.put([block(b"x", 256)])
        with pytest.raises(ServiceDownError):
            other.get([b"x"], wait_s=30.0)
        assert other._sock is None  # it did not even open a socket
    finally:
        store.close()
        other.close()


def test_damage_is_caught_by_the_consumer_check():
    good = block(b"k", 1024)
    assert is_intact(good, "float32", [256])
    flipped = good.data.copy()
    flipped[100] ^= 0xFF
    assert not is_intact(KVBlock(b"k", "float32", [256], good.checksum, flipped), "float32", [256])
    assert not is_intact(good, "bfloat16", [256])  # another dtype
    assert not is_intact(good, "float32", [128, 2])  # another shape
