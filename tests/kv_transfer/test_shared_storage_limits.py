"""The shared KV folder under a full disk and a size cap.

Before: a write that failed (ENOSPC) left its ``.tmp`` file behind, the folder
grew without bound, and its default was a RAM-backed runtime folder.
"""

from __future__ import annotations

import errno
import os
import time

import pytest

from services.kv_transfer import shared_storage
from services.kv_transfer.block_store import seal
from services.kv_transfer.shared_storage import FileBlockStore, default_storage_path
from tests.kv_transfer.test_service import block

BLOCK_BYTES = 64 * 1024


def put(store: FileBlockStore, key: bytes) -> None:
    store.put([seal(block(key, BLOCK_BYTES), None)])


def files(store: FileBlockStore) -> list[str]:
    return sorted(os.listdir(store.path))


def full_disk(limit: int):
    """A ``write_all`` that writes ``limit`` bytes of each payload, then fails as a full disk does."""

    def write_all(f, payload: bytes) -> None:
        f.write(payload[:limit])
        raise OSError(errno.ENOSPC, "No space left on device")

    return write_all


def test_a_write_that_fails_leaves_no_temporary_file(tmp_path, monkeypatch):
    store = FileBlockStore(tmp_path / "kv")
    monkeypatch.setattr(shared_storage, "write_all", full_disk(1000))
    with pytest.raises(OSError) as raised:
        put(store, b"a")
    assert raised.value.errno == errno.ENOSPC
    assert files(store) == []  # neither the block nor a .tmp file
    assert store.get([b"a"], 0.0) == {}


def test_a_full_disk_evicts_old_blocks_and_the_write_goes_through(tmp_path, monkeypatch):
    store = FileBlockStore(tmp_path / "kv")
    for i in range(4):
        put(store, b"old%d" % i)
    attempts = []
    real = shared_storage.write_all

    def fills_once(f, payload: bytes) -> None:
        attempts.append(len(payload))
        if len(attempts) == 1:
            full_disk(500)(f, payload)
        real(f, payload)

    monkeypatch.setattr(shared_storage, "write_all", fills_once)
    put(store, b"new")
    assert len(attempts) == 2 and store.num_evicted == 2  # half the folder went
    assert b"new" in store.get([b"new"], 0.0)
    assert not [name for name in files(store) if name.endswith(".tmp")]


def test_the_folder_keeps_to_its_cap_evicting_the_least_recently_used(tmp_path):
    file_bytes = len(shared_storage.read_block_file(_one_block_file(tmp_path)))
    store = FileBlockStore(tmp_path / "kv", max_bytes=4 * file_bytes + file_bytes // 2)
    for i in range(3):
        put(store, b"k%d" % i)
        os.utime(store.file_of(b"k%d" % i), ns=(i * 10**9, i * 10**9))  # written in this order
    assert b"k0" in store.get([b"k0"], 0.0)  # read: now the most recently used
    for i in range(3, 10):
        put(store, b"k%d" % i)
    on_disk = [name for name in files(store) if name.endswith(".safetensors")]
    assert sum(os.path.getsize(store.path / name) for name in on_disk) <= store.max_bytes
    assert store.file_of(b"k9").name in on_disk  # the newest stays
    assert store.file_of(b"k1").name not in on_disk and store.file_of(b"k2").name not in on_disk
    assert store.num_evicted >= 6


def test_a_crashed_writers_temporary_files_are_deleted(tmp_path):
    folder = tmp_path / "kv"
    FileBlockStore(folder)
    stale, fresh = folder / ".dead.safetensors.1234.tmp", folder / ".live.safetensors.5678.tmp"
    stale.write_bytes(b"x" * 100)
    fresh.write_bytes(b"x" * 100)  # another writer's, still being written
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    FileBlockStore(folder)
    assert not stale.exists() and fresh.exists()


def test_the_default_folder_is_on_disk_not_in_the_runtime_tmpfs(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_storage_path() == tmp_path / "home" / ".cache" / "weft" / "kv-cache"


def _one_block_file(tmp_path) -> os.PathLike:
    probe = FileBlockStore(tmp_path / "probe")
    put(probe, b"probe")
    return probe.file_of(b"probe")
