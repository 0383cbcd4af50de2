"""The worker's transfer thread over both stores: save on one cache, load
into another, and a damaged or missing block cuts the load short."""

from __future__ import annotations

import pytest
import torch

from protocol.kv_transfer import KVBlockTransfer
from services.kv_transfer.kv_blocks import PagedKVBlocks
from services.kv_transfer.shared_storage import FileBlockStore
from services.kv_transfer.transfer_thread import CHUNK_BLOCKS, TransferThread
from services.kv_transfer.zmq_connector import ZmqBlockStore
from tests.kv_transfer.test_kv_blocks import caches, caches_of
from tests.kv_transfer.test_service import RunningService

HASHES = [bytes([i]) * 32 for i in range(5)]


def key_of(block_hash: bytes) -> bytes:
    return b"ns" + block_hash


@pytest.fixture(params=["files", "zmq"])
def make_store(request, tmp_path):
    if request.param == "files":
        yield lambda: FileBlockStore(tmp_path / "kv")
        return
    service = RunningService(max_bytes=1 << 24)
    yield lambda: ZmqBlockStore(service.address, timeout_s=5.0)
    service.close()


def run(thread: TransferThread, kind: str, transfer: KVBlockTransfer) -> tuple[list[str], dict[str, int]]:
    thread.submit(kind, transfer)
    return thread.take_finished(wait_s=30.0)


def test_save_then_load_moves_the_kv_between_caches(make_store):
    producer = TransferThread(make_store(), PagedKVBlocks(caches(seed=1)), key_of)
    consumer = TransferThread(make_store(), PagedKVBlocks(caches(seed=2)), key_of)
    try:
        assert run(producer, "save", KVBlockTransfer("p", [1, 2, 3, 4, 5], HASHES)) == (["p"], {})
        assert run(consumer, "load", KVBlockTransfer("c", [7, 6, 5, 4, 3], HASHES)) == ([], {"c": 5})
        for src, dst in zip(producer.blocks.kv_caches, consumer.blocks.kv_caches):
            assert torch.equal(dst[:, :, [7, 6, 5, 4, 3]], src[:, :, [1, 2, 3, 4, 5]])
        assert producer.stats.blocks_saved == consumer.stats.blocks_loaded == 5
        assert consumer.stats.bytes_loaded == 5 * consumer.blocks.block_nbytes
    finally:
        producer.close()
        consumer.close()


def test_a_load_stops_at_the_first_missing_block(make_store):
    producer = TransferThread(make_store(), PagedKVBlocks(caches(seed=1)), key_of)
    consumer = TransferThread(make_store(), PagedKVBlocks(caches(seed=2)), key_of)
    try:
        run(producer, "save", KVBlockTransfer("p", [1, 2], HASHES[:2]))
        run(producer, "save", KVBlockTransfer("p2", [4], HASHES[3:4]))  # block 2 of the chain is missing
        before = consumer.blocks.kv_caches[0][:, :, 5].clone()
        assert run(consumer, "load", KVBlockTransfer("c", [3, 4, 5, 6], HASHES[:4]))[1] == {"c": 2}
        assert torch.equal(consumer.blocks.kv_caches[0][:, :, 5], before)  # nothing written past the gap
    finally:
        producer.close()
        consumer.close()


def test_a_damaged_block_is_refused(tmp_path):
    store_dir = tmp_path / "kv"
    producer = TransferThread(FileBlockStore(store_dir), PagedKVBlocks(caches(seed=1)), key_of)
    consumer = TransferThread(FileBlockStore(store_dir), PagedKVBlocks(caches(seed=2)), key_of)
    try:
        run(producer, "save", KVBlockTransfer("p", [1, 2, 3], HASHES[:3]))
        path = FileBlockStore(store_dir).file_of(key_of(HASHES[1]))
        raw = bytearray(path.read_bytes())
        raw[-5] ^= 0xFF  # one flipped bit pattern inside the tensor's bytes
        path.write_bytes(bytes(raw))
        assert run(consumer, "load", KVBlockTransfer("c", [4, 5, 6], HASHES[:3]))[1] == {"c": 1}
        assert consumer.stats.blocks_refused == 1
    finally:
        producer.close()
        consumer.close()


def test_a_load_from_a_dead_service_reports_nothing_loaded():
    service = RunningService()
    address = service.address
    service.close()
    consumer = TransferThread(ZmqBlockStore(address, timeout_s=0.2), PagedKVBlocks(caches()), key_of)
    try:
        assert run(consumer, "load", KVBlockTransfer("c", [1], HASHES[:1], wait_s=0.1)) == ([], {"c": 0})
        assert run(consumer, "save", KVBlockTransfer("p", [1], HASHES[:1])) == (["p"], {})  # released anyway
    finally:
        consumer.close()


def test_file_store_probe_and_atomic_files(tmp_path):
    producer = TransferThread(FileBlockStore(tmp_path), PagedKVBlocks(caches()), key_of)
    try:
        run(producer, "save", KVBlockTransfer("p", [1, 2], HASHES[:2]))
    finally:
        producer.close()
    probe = FileBlockStore(tmp_path)
    assert probe.num_present([key_of(h) for h in HASHES]) == 2
    assert not list(tmp_path.glob(".*.tmp"))  # written under a temporary name, then renamed


def test_long_transfers_go_in_chunks(make_store):
    """More blocks than one store request holds: every chunk arrives, in order."""
    num_blocks = CHUNK_BLOCKS + 3
    hashes = [i.to_bytes(32, "little") for i in range(num_blocks)]
    producer = TransferThread(make_store(), PagedKVBlocks(caches_of(num_blocks + 1, seed=3)), key_of)
    consumer = TransferThread(make_store(), PagedKVBlocks(caches_of(num_blocks + 1, seed=4)), key_of)
    try:
        ids = list(range(1, num_blocks + 1))
        run(producer, "save", KVBlockTransfer("p", ids, hashes))
        assert run(consumer, "load", KVBlockTransfer("c", ids[::-1], hashes))[1] == {"c": num_blocks}
        for src, dst in zip(producer.blocks.kv_caches, consumer.blocks.kv_caches):
            assert torch.equal(dst[:, :, ids[::-1]], src[:, :, ids])
    finally:
        producer.close()
        consumer.close()


def test_a_load_waiting_for_blocks_does_not_hold_up_the_others(make_store):
    """Two transfer threads: a load whose blocks never come waits out its time
    on one, while a load of blocks that are there finishes on the other."""
    producer = TransferThread(make_store(), PagedKVBlocks(caches(seed=1)), key_of)
    consumer = TransferThread(
        make_store(), PagedKVBlocks(caches(seed=2)), key_of, make_store=make_store, max_concurrent=2
    )
    try:
        run(producer, "save", KVBlockTransfer("p", [1], HASHES[:1]))
        consumer.submit("load", KVBlockTransfer("stuck", [2], HASHES[4:5], wait_s=5.0))  # never saved
        consumer.submit("load", KVBlockTransfer("ready", [3], HASHES[:1]))
        assert consumer.take_finished(wait_s=30.0) == ([], {"ready": 1})  # first, while "stuck" waits
        assert consumer.take_finished(wait_s=30.0) == ([], {"stuck": 0})
    finally:
        producer.close()
        consumer.close()
