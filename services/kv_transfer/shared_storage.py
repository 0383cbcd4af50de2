"""SharedStorageConnector: KV blocks as safetensors files in a shared folder.

One file per block, ``<path>/<key hex>.safetensors``, holding the block's
tensor ``kv`` ([layers, 2, kv_heads, block_size, head_dim], in the cache's
dtype) and its producer's CRC-32 (or keyed MAC) in the metadata. A file is
written under a temporary name and renamed, so a reader sees a whole block
or none. Any engine that mounts the folder can load what another saved: a
consumer finds blocks by their keys even without ``kv_transfer_params`` (the
folder is cheap to probe).

The folder is trusted only if it is private: by default one of this user's
own (``default_storage_path``, created 0700), and any folder is refused when
another user owns it or may write to it (a pre-created ``/tmp`` folder of
someone else would let them read or plant blocks). Files are created 0600.
A block file is opened without following links and without blocking (a
FIFO named like a block must not hang the transfer thread), and read only if
it is a regular file whose size is exactly what its own header describes.

The folder is bounded: past ``max_bytes`` of block files (default 4 GiB) a
writer deletes the least recently used blocks (a read refreshes a block's
time) down to 90% of it; a write that fails (ENOSPC) deletes its temporary
file, evicts half the folder and tries once more; temporary files that
crashed writers left are deleted when the folder is next scanned. Several
writers share the cap: each rescans the folder every ``_RESCAN_S``, so the
cap holds to within a few seconds of their writes. The default folder is on
disk (``~/.cache``), not a RAM-backed runtime folder.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import struct
import time
import uuid
from pathlib import Path

from protocol.kv_transfer import KVBlock
from protocol.zmq_sockets import DEFAULT_MAX_MSG_SIZE
from services.config.kv_transfer_args import DEFAULT_SHARED_STORAGE_MAX_BYTES, SharedStorageOptions
from services.kv_transfer.block_connector import BlockConnector
from services.kv_transfer.block_store import BlockStore

_POLL_S = 0.01  # how often a load re-checks for files a producer is still writing
# The largest block file read: a block as large as the wire allows, plus its header.
MAX_BLOCK_FILE_BYTES = DEFAULT_MAX_MSG_SIZE
_MAX_HEADER_BYTES = 1 << 16
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_SUFFIX = ".safetensors"
# Eviction brings the folder down to this share of its cap, so it does not run at every write.
_LOW_WATER = 0.9
# How often a writer re-reads the folder's size (other writers add to it).
_RESCAN_S = 5.0
# A temporary file older than this is a crashed writer's: deleted on the next scan.
_STALE_TMP_S = 60.0

logger = logging.getLogger(__name__)


def default_storage_path() -> Path:
    """This user's own folder on disk, under ~/.cache (not a RAM-backed runtime folder:
    blocks would take the machine's memory)."""
    return Path.home() / ".cache" / "weft" / "kv-cache"


def check_private_folder(path: Path) -> None:
    """PermissionError unless ``path`` is a real folder of this user that no other user may write."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"shared_storage_path {path} is not a folder (or is a link).")
    if info.st_uid != os.getuid():
        raise PermissionError(
            f"shared_storage_path {path} belongs to uid {info.st_uid}, not to this user "
            f"(uid {os.getuid()}): another user could read or plant KV blocks there."
        )
    if info.st_mode & 0o022:
        raise PermissionError(
            f"shared_storage_path {path} may be written by other users (mode "
            f"{stat.S_IMODE(info.st_mode):o}); `chmod go-w {path}`."
        )


class FileBlockStore(BlockStore):
    discoverable = True

    def __init__(
        self, path: str | os.PathLike | None, max_bytes: int = DEFAULT_SHARED_STORAGE_MAX_BYTES
    ) -> None:
        self.path = Path(path) if path is not None else default_storage_path()
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            self.path.mkdir(mode=0o700)
        except FileExistsError:
            pass
        check_private_folder(self.path)
        self.max_bytes = max_bytes
        self.num_evicted = 0  # block files this store deleted to keep the cap
        self._bytes = 0  # the folder's block bytes, as of the last scan plus this store's writes
        self._scanned_at = 0.0
        self._scan(evict_to=None)

    def file_of(self, key: bytes) -> Path:
        return self.path / f"{key.hex()}{_SUFFIX}"

    def num_present(self, keys: list[bytes]) -> int:
        for i, key in enumerate(keys):
            try:
                if not stat.S_ISREG(os.lstat(self.file_of(key)).st_mode):
                    return i
            except OSError:
                return i
        return len(keys)

    def put(self, blocks: list[KVBlock]) -> None:
        import torch
        from safetensors.torch import save

        from services.kv_transfer.kv_blocks import torch_dtype

        for block in blocks:
            raw = torch.frombuffer(bytearray(block.data), dtype=torch.uint8)
            tensor = raw.view(torch_dtype(block.dtype)).view(block.shape)
            metadata = {"checksum": str(block.checksum), "mac": bytes(block.mac).hex()}
            payload = save({"kv": tensor}, metadata=metadata)
            final = self.file_of(block.key)
            try:
                self._write(final, payload)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                logger.warning("The KV folder %s is out of space: evicting half of it.", self.path)
                self._scan(evict_to=self._bytes // 2)
                self._write(final, payload)
            self._bytes += len(payload)
            if self._bytes > self.max_bytes or time.monotonic() - self._scanned_at > _RESCAN_S:
                self._scan(evict_to=int(self.max_bytes * _LOW_WATER))

    def _write(self, final: Path, payload: bytes) -> None:
        """``payload`` into ``final`` through a temporary file, which never outlives a failure."""
        temp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                write_all(f, payload)
            os.replace(temp, final)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    def _scan(self, evict_to: int | None) -> None:
        """Re-read the folder's size, delete crashed writers' temporary files and, past
        ``evict_to`` bytes, the least recently used blocks."""
        now = time.time()
        blocks = []
        with os.scandir(self.path) as entries:
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # another writer's rename or eviction
                if not stat.S_ISREG(info.st_mode):
                    continue
                if entry.name.endswith(".tmp"):
                    if now - info.st_mtime > _STALE_TMP_S:
                        _unlink(entry.path)
                elif entry.name.endswith(_SUFFIX):
                    blocks.append((info.st_mtime_ns, entry.name, info.st_size))
        total = sum(size for _, _, size in blocks)
        if evict_to is not None and total > evict_to:
            for _, name, size in sorted(blocks):
                if total <= evict_to:
                    break
                if _unlink(self.path / name):
                    self.num_evicted += 1
                total -= size
        self._bytes, self._scanned_at = total, time.monotonic()

    def get(self, keys: list[bytes], wait_s: float) -> dict[bytes, KVBlock]:
        deadline = time.monotonic() + wait_s
        found: dict[bytes, KVBlock] = {}
        while True:
            for key in keys:
                if key not in found and (block := self._read(key)) is not None:
                    found[key] = block
            if len(found) == len(keys) or time.monotonic() >= deadline:
                return found
            time.sleep(_POLL_S)  # files appear as the producer writes them

    def _read(self, key: bytes) -> KVBlock | None:
        """The block in ``key``'s file; None if absent, not a regular file, or damaged."""
        path = self.file_of(key)
        try:
            raw = read_block_file(path)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return None  # a damaged or hostile file is a block that is not there: the consumer computes it
        block = _decode(key, raw)
        if block is not None:
            try:
                os.utime(path, follow_symlinks=False)  # used: the last to be evicted
            except OSError:
                pass  # evicted meanwhile: the block was read whole
        return block


def write_all(f, payload: bytes) -> None:
    """Write ``payload`` to the open file ``f`` (a seam for tests that fill the disk)."""
    f.write(payload)


def _unlink(path: str | Path) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False  # another writer took it first


def read_block_file(path: Path) -> bytes:
    """A block file's bytes: a regular file (no link, no FIFO or device) whose
    size is what its safetensors header describes. ValueError otherwise."""
    fd = os.open(path, _OPEN_FLAGS)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path.name} is not a regular file")
        if not 8 < info.st_size <= MAX_BLOCK_FILE_BYTES:
            raise ValueError(f"{path.name} has an impossible size ({info.st_size} bytes)")
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > min(_MAX_HEADER_BYTES, info.st_size - 8):
            raise ValueError(f"{path.name}: header of {header_len} bytes")
        data_end = _data_end(f.read(header_len))
        if info.st_size != 8 + header_len + data_end:
            raise ValueError(
                f"{path.name}: {info.st_size} bytes, its header describes {8 + header_len + data_end}"
            )
        f.seek(0)
        return f.read(info.st_size)


def _data_end(header: bytes) -> int:
    """Where the last tensor's bytes end, per a safetensors header."""
    try:
        entries = json.loads(header)
        ends = (int(entry["data_offsets"][1]) for name, entry in entries.items() if name != "__metadata__")
        return max(ends, default=0)
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
        raise ValueError(f"not a safetensors header: {e}") from None


def _decode(key: bytes, raw: bytes) -> KVBlock | None:
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensor = load(raw)["kv"]
        header_len = struct.unpack("<Q", raw[:8])[0]
        metadata = json.loads(raw[8 : 8 + header_len]).get("__metadata__") or {}
        recorded = int(metadata.get("checksum", "-1"))
        mac = bytes.fromhex(metadata.get("mac", ""))
    except (SafetensorError, KeyError, ValueError, TypeError, AttributeError):
        return None
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    return KVBlock(
        key=key,
        dtype=str(tensor.dtype).removeprefix("torch."),
        shape=list(tensor.shape),
        checksum=recorded,
        data=data,
        mac=mac,
    )


class SharedStorageConnector(BlockConnector):
    def _make_store(self) -> FileBlockStore:
        options = self.options
        assert isinstance(options, SharedStorageOptions)
        return FileBlockStore(options.shared_storage_path, options.max_bytes)
