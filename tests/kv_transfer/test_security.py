"""Attacks on the KV-transfer path, run against the real service, stores and
transfer threads: a keyless or stranger peer on the kv_transfer service, a
forged block under a real key, blocks of another checkpoint with the same
file name, a storage folder planted by another user, a FIFO named like a
block, and floods of parked gets or tiny blocks."""

from __future__ import annotations

import os
import shutil
import stat
import threading

import msgspec
import numpy as np
import pytest
import torch
import zmq

from protocol.codec import Decoder, Encoder
from protocol.curve import CLIENT, CurveKeys, generate_keys, load_keys
from protocol.kv_transfer import KVBlock, KVBlockTransfer, KVGet, KVPut, KVServiceReply, KVStatsRequest
from protocol.zmq_sockets import make_socket, recv, send, tcp_address
from services.kv_transfer.block_store import block_mac, is_intact, seal
from services.kv_transfer.keys import engine_curve_keys, mac_key, service_curve_keys
from services.kv_transfer.kv_blocks import PagedKVBlocks
from services.kv_transfer.namespace import block_namespace
from services.kv_transfer.service import (
    MAX_PARKED_GETS,
    MAX_WAIT_MS,
    KVTransferService,
    entry_size,
)
from services.kv_transfer.shared_storage import FileBlockStore, default_storage_path
from services.kv_transfer.transfer_thread import TransferThread
from services.kv_transfer.zmq_connector import ZmqBlockStore
from tests.engine_core.fakes import make_config
from tests.kv_transfer.test_kv_blocks import caches
from tests.kv_transfer.test_service import block

NOBODY = 65534
HASHES = [bytes([i]) * 32 for i in range(3)]


def key_of(block_hash: bytes) -> bytes:
    return b"ns" + block_hash


@pytest.fixture
def keys(tmp_path):
    folder = tmp_path / "keys"
    generate_keys(folder)
    return folder


class CurveService:
    def __init__(self, keys, max_bytes: int = 1 << 24) -> None:
        self.service = KVTransferService(
            tcp_address("127.0.0.1", 0, bind=True), max_bytes, curve=service_curve_keys(keys)
        )
        self.address = self.service.address
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.service.serve, args=(self.stop,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


@pytest.fixture
def curve_service(keys):
    running = CurveService(keys)
    yield running
    running.close()


# ---- the kv_transfer service behind CURVE


def test_a_keyless_peer_can_neither_read_nor_write_the_service(keys, curve_service):
    engine = ZmqBlockStore(curve_service.address, timeout_s=5.0, curve=engine_curve_keys(keys))
    public, secret = zmq.curve_keypair()
    stranger_keys = CurveKeys(CLIENT, public, secret, load_keys(keys, CLIENT).peer_public)
    try:
        engine.put([block(b"secret-kv", 1024, fill=3)])
        for curve in (None, stranger_keys):  # no CURVE at all; CURVE with a key of its own
            peer = ZmqBlockStore(curve_service.address, timeout_s=0.5, curve=curve)
            try:
                with pytest.raises(TimeoutError):
                    peer.get([b"secret-kv"], wait_s=0.0)  # cannot read
            finally:
                peer.close()
            # Cannot write either: a put straight on a socket, never answered and never stored.
            ctx = zmq.Context.instance()
            raw = make_socket(ctx, zmq.DEALER, curve_service.address, bind=False, curve=curve)
            # Once the service has refused the handshake the DEALER has no peer, and a send
            # blocks: seen once under load, where the refusal came before the put.
            raw.setsockopt(zmq.SNDTIMEO, 500)
            put = KVPut(1, [block(b"secret-kv", 1024, fill=9), block(b"planted", 64)])
            try:
                send(raw, Encoder(), put)
                assert not raw.poll(500)
            except zmq.Again:  # refused before the put could leave
                pass
            finally:
                raw.close(linger=0)
        assert curve_service.service.auth.num_denied >= 1
        found = engine.get([b"secret-kv", b"planted"], wait_s=0.0)
        # Nothing replaced or planted.
        assert set(found) == {b"secret-kv"} and found[b"secret-kv"].data[0] == 3
        assert engine.stats().num_stored == 1
    finally:
        engine.close()


# ---- forged blocks


@pytest.fixture(params=["files", "zmq"])
def make_store(request, tmp_path, keys):
    if request.param == "files":
        yield lambda: FileBlockStore(tmp_path / "kv")
        return
    running = CurveService(keys)
    yield lambda: ZmqBlockStore(running.address, timeout_s=5.0, curve=engine_curve_keys(keys))
    running.close()


def test_a_forged_block_under_a_real_key_is_refused(make_store, keys, tmp_path):
    secret = mac_key(keys)
    producer = TransferThread(make_store(), PagedKVBlocks(caches(seed=1)), key_of, mac_key=secret)
    consumer = TransferThread(make_store(), PagedKVBlocks(caches(seed=2)), key_of, mac_key=secret)
    forger = make_store()
    try:
        producer.submit("save", KVBlockTransfer("p", [1, 2, 3], HASHES))
        assert producer.take_finished(wait_s=30) == (["p"], {})
        # The attacker replaces block 1: its own KV, sealed without the deployment's key
        # (a key of its own, a CRC-32, no MAC at all).
        original = forger.get([key_of(HASHES[1])], 0.0)[key_of(HASHES[1])]
        data = np.frombuffer(torch.randn(original.data.nbytes // 4).numpy().tobytes(), np.uint8).copy()
        for mac in (block_mac(os.urandom(32), original.key, original.dtype, original.shape, data), b""):
            forged = KVBlock(original.key, original.dtype, list(original.shape), 0, data, mac)
            if not mac:
                seal(forged, None)  # a valid CRC-32 instead
            forger.put([forged])
            refused = consumer.stats.blocks_refused
            consumer.submit("load", KVBlockTransfer("c", [4, 5, 6], HASHES))
            assert consumer.take_finished(wait_s=30)[1] == {"c": 1}  # block 0 only; the rest is computed
            assert consumer.stats.blocks_refused == refused + 1
    finally:
        producer.close()
        consumer.close()
        forger.close()


def test_the_mac_covers_the_key_and_the_header():
    secret = os.urandom(32)
    good = seal(block(b"k1", 1024), secret)
    assert is_intact(good, "float32", [256], secret) and not is_intact(good, "float32", [256], os.urandom(32))
    moved = msgspec.structs.replace(good, key=b"k2")  # a genuine block replayed under another key
    assert not is_intact(moved, "float32", [256], secret)
    reshaped = msgspec.structs.replace(good, shape=[128, 2])
    assert not is_intact(reshaped, "float32", [128, 2], secret)


# ---- namespaces identify the checkpoint


def _config_for(path) -> object:
    config = make_config(block_size=16)
    return msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, model=str(path)))


def test_two_checkpoints_with_one_name_never_share_a_namespace(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    rng = np.random.default_rng(0)
    weights = rng.integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()  # past the sampling threshold
    (a / "llama.gguf").write_bytes(weights)
    other = bytearray(weights)
    other[10] ^= 1  # another model, the same size and name
    (b / "llama.gguf").write_bytes(bytes(other))
    assert block_namespace(_config_for(a / "llama.gguf")) != block_namespace(_config_for(b / "llama.gguf"))
    # One checkpoint under another name and folder: the same blocks.
    shutil.copy(a / "llama.gguf", tmp_path / "renamed.gguf")
    renamed = block_namespace(_config_for(tmp_path / "renamed.gguf"))
    assert block_namespace(_config_for(a / "llama.gguf")) == renamed
    # A folder checkpoint: its config counts too.
    for folder, layers in ((a, 2), (b, 3)):
        (folder / "config.json").write_text(f'{{"num_hidden_layers": {layers}}}')
        (folder / "model.safetensors").write_bytes(weights)
    assert block_namespace(_config_for(a)) != block_namespace(_config_for(b))


# ---- the shared-storage folder


def test_a_storage_folder_another_user_owns_or_can_write_is_refused(tmp_path):
    planted = tmp_path / "weft-kv-cache"
    planted.mkdir(mode=0o700)
    os.chown(planted, NOBODY, NOBODY)  # pre-created by someone else
    with pytest.raises(PermissionError, match="belongs to uid"):
        FileBlockStore(planted)
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    with pytest.raises(PermissionError, match="written by other users"):
        FileBlockStore(open_folder)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    with pytest.raises(PermissionError, match="link"):
        FileBlockStore(tmp_path / "link")


def test_blocks_are_private_files_in_a_private_default_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_storage_path() == tmp_path / ".cache" / "weft" / "kv-cache"
    store = FileBlockStore(None)
    assert store.path == tmp_path / ".cache" / "weft" / "kv-cache"
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o700
    store.put([seal(block(b"k", 1024), None)])
    assert stat.S_IMODE(os.stat(store.file_of(b"k")).st_mode) == 0o600
    assert store.get([b"k"], 0.0)[b"k"].data.nbytes == 1024


def test_a_fifo_or_a_lying_file_named_like_a_block_does_not_hang_or_load(tmp_path):
    store = FileBlockStore(tmp_path / "kv")
    os.mkfifo(store.file_of(b"fifo"))  # nobody will ever write to it
    store.put([seal(block(b"short", 1024), None)])
    path = store.file_of(b"short")
    path.write_bytes(path.read_bytes()[:-10])  # shorter than its header says
    os.symlink(path, store.file_of(b"link"))
    result = {}
    reader = threading.Thread(target=lambda: result.update(store.get([b"fifo", b"short", b"link"], 0.0)))
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "reading a FIFO named like a block hung"
    assert result == {}
    assert store.num_present([b"fifo"]) == 0


# ---- the service's memory and waiting gets are bounded


def test_parked_gets_are_bounded_in_number_and_wait(keys, curve_service):
    ctx = zmq.Context.instance()
    sock = make_socket(ctx, zmq.DEALER, curve_service.address, bind=False, curve=engine_curve_keys(keys))
    encoder, decoder = Encoder(), Decoder(KVServiceReply)
    try:
        for seq in range(MAX_PARKED_GETS + 10):  # each asks to wait far longer than allowed
            send(sock, encoder, KVGet(seq, [b"never"], wait_ms=10 * MAX_WAIT_MS))
        answered = set()
        while len(answered) < 10:  # those past the bound are answered at once, as misses
            assert sock.poll(10_000), "gets past the bound were parked"
            _, reply = recv(sock, decoder)
            assert reply.missing == [b"never"]
            answered.add(reply.seq)
        # A round trip after them: the service has finished with every get by its reply.
        send(sock, encoder, KVStatsRequest(10_000))
        while (reply := recv(sock, decoder)[1]).seq != 10_000:
            assert sock.poll(10_000)
        assert len(curve_service.service._parked) == MAX_PARKED_GETS
        assert (
            max(p.deadline for p in curve_service.service._parked)
            <= min(p.deadline for p in curve_service.service._parked) + MAX_WAIT_MS / 1000
        )
        assert curve_service.service.num_refused_gets == 10
    finally:
        sock.close(linger=0)


def test_the_memory_cap_counts_every_entry_not_only_its_bytes(keys):
    tiny = [block(i.to_bytes(8, "little"), 0) for i in range(5000)]  # no data at all: free, by data bytes
    running = CurveService(keys, max_bytes=100 * entry_size(tiny[0]))
    client = ZmqBlockStore(running.address, timeout_s=10.0, curve=engine_curve_keys(keys))
    try:
        for lo in range(0, len(tiny), 1000):
            client.put(tiny[lo : lo + 1000])
        stats = client.stats()
        assert stats.num_blocks == 100 and stats.num_bytes <= stats.max_bytes
        assert stats.num_evicted == len(tiny) - 100
    finally:
        client.close()
        running.close()
