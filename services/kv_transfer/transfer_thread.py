"""The worker's transfer threads: saves and loads run off the forward path.

Jobs come from the step's plan and run on up to ``max_concurrent`` threads,
each owning its own block store client (its socket or files), so one slow
transfer (a consumer waiting for blocks a producer has not pushed yet, a
store that does not answer) does not hold up the others. A save copies its blocks
out of the cache and stores them; the scheduler keeps those blocks until the
save is reported, so nothing overwrites them meanwhile. A load fetches,
checks and writes blocks the scheduler allocated to a request that is not
running, so no forward reads them meanwhile. Torch and ZMQ release the GIL,
so the thread overlaps the forward passes.

A job never fails the engine: a save that could not be stored is reported
done (the consumer will recompute), and a load reports how many leading
blocks arrived intact, zero if none (the rest is computed). A load has a
hard deadline from its submission (its wait plus one store timeout): past
it, nothing more is written into the cache, so the scheduler may give the
blocks of an aborted request back after its own, longer, timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from protocol.kv_transfer import KVBlockTransfer
from services.config.kv_transfer_args import DEFAULT_TIMEOUT_S
from services.kv_transfer.block_store import BlockStore, is_intact
from services.kv_transfer.kv_blocks import PagedKVBlocks

logger = logging.getLogger(__name__)

# Blocks per store request: bounds the memory of one message (~11 MiB of
# fp32 KV for the default model) and lets a consumer start on early blocks.
CHUNK_BLOCKS = 16


@dataclass
class TransferStats:
    """Running totals of this worker's transfers (bytes and wall time)."""

    blocks_saved: int = 0
    bytes_saved: int = 0
    save_s: float = 0.0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_s: float = 0.0
    blocks_refused: int = 0  # arrived damaged or of another shape/dtype


@dataclass(frozen=True)
class _Job:
    kind: str  # "save" or "load"
    transfer: KVBlockTransfer
    deadline: float  # loads: no write into the cache after this (monotonic)


class TransferThread:
    def __init__(
        self,
        store: BlockStore,
        blocks: PagedKVBlocks,
        key_of: Callable[[bytes], bytes],
        *,
        mac_key: bytes | None = None,
        make_store: Callable[[], BlockStore] | None = None,
        max_concurrent: int = 1,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        """``store`` serves the first thread; ``make_store`` makes one for each further thread."""
        if max_concurrent > 1 and make_store is None:
            raise ValueError("more than one transfer thread needs make_store (a store client per thread)")
        self.stores = [store] + [make_store() for _ in range(max_concurrent - 1)]
        self.blocks = blocks
        self.key_of = key_of  # block hash -> store key
        self.mac_key = mac_key  # blocks are sealed and checked with it (None: CRC-32)
        self.timeout_s = timeout_s
        self.stats = TransferStats()
        self._stats_lock = threading.Lock()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._done: queue.Queue[tuple[str, str, int]] = queue.Queue()
        self._num_in_flight = 0  # submitted, not yet taken back (main thread only)
        self._threads = [
            threading.Thread(target=self._run, args=(s,), name=f"kv-transfer-{i}", daemon=True)
            for i, s in enumerate(self.stores)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def store(self) -> BlockStore:
        return self.stores[0]

    def submit(self, kind: str, transfer: KVBlockTransfer) -> None:
        assert kind in ("save", "load"), kind
        self._num_in_flight += 1
        deadline = time.monotonic() + transfer.wait_s + self.timeout_s
        self._jobs.put(_Job(kind, transfer, deadline))

    def take_finished(self, wait_s: float = 0.0) -> tuple[list[str], dict[str, int]]:
        """Jobs done since the last call, waiting up to ``wait_s`` for the first one."""
        sent: list[str] = []
        received: dict[str, int] = {}
        block = wait_s > 0 and self._num_in_flight > 0
        while True:
            try:
                kind, req_id, num_blocks = (
                    self._done.get(timeout=wait_s) if block else self._done.get_nowait()
                )
            except queue.Empty:
                return sent, received
            block = False
            self._num_in_flight -= 1
            if kind == "save":
                sent.append(req_id)
            else:
                received[req_id] = num_blocks

    def close(self) -> None:
        alive = [t for t in self._threads if t.is_alive()]
        for _ in alive:
            self._jobs.put(None)
        for thread in alive:
            thread.join(timeout=10)
        for store in self.stores:
            store.close()

    # ---- the threads

    def _run(self, store: BlockStore) -> None:
        while (job := self._jobs.get()) is not None:
            transfer = job.transfer
            try:
                if job.kind == "save":
                    self._save(store, transfer)
                    result = len(transfer.block_ids)
                else:
                    result = self._load(store, job)
            except Exception:
                logger.exception("KV %s of request %s failed", job.kind, transfer.req_id)
                result = 0
            self._done.put((job.kind, transfer.req_id, result))

    def _save(self, store: BlockStore, transfer: KVBlockTransfer) -> None:
        start = time.perf_counter()
        for lo in range(0, len(transfer.block_ids), CHUNK_BLOCKS):
            ids = transfer.block_ids[lo : lo + CHUNK_BLOCKS]
            keys = [self.key_of(h) for h in transfer.block_hashes[lo : lo + CHUNK_BLOCKS]]
            try:
                store.put(self.blocks.to_wire(keys, self.blocks.gather(ids), self.mac_key))
            except (OSError, TimeoutError) as e:
                # The consumer finds the blocks missing and computes them.
                logger.warning(
                    "KV save of request %s stopped after %d of %d blocks: %s",
                    transfer.req_id,
                    lo,
                    len(transfer.block_ids),
                    e,
                )
                return
        self._count("save", len(transfer.block_ids), time.perf_counter() - start)

    def _load(self, store: BlockStore, job: _Job) -> int:
        """Load the longest intact prefix of the asked blocks; returns its length."""
        transfer = job.transfer
        start = time.perf_counter()
        wait_until = time.monotonic() + transfer.wait_s
        loaded = 0
        for lo in range(0, len(transfer.block_ids), CHUNK_BLOCKS):
            keys = [self.key_of(h) for h in transfer.block_hashes[lo : lo + CHUNK_BLOCKS]]
            try:
                found = store.get(keys, max(0.0, min(wait_until, job.deadline) - time.monotonic()))
            except (OSError, TimeoutError) as e:
                logger.warning(
                    "KV load of request %s stopped after %d blocks: %s", transfer.req_id, loaded, e
                )
                break
            good = self._intact_prefix(keys, found)
            if time.monotonic() > job.deadline:
                # The scheduler may be about to hand these blocks to someone else.
                logger.warning(
                    "KV load of request %s ran past its deadline after %d blocks; stopped.",
                    transfer.req_id,
                    loaded,
                )
                break
            if good:
                self.blocks.scatter(transfer.block_ids[lo : lo + len(good)], self.blocks.from_wire(good))
            loaded += len(good)
            if len(good) < len(keys):
                logger.info(
                    "KV load of request %s: %d of %d blocks usable; the rest is computed.",
                    transfer.req_id,
                    loaded,
                    len(transfer.block_ids),
                )
                break
        self._count("load", loaded, time.perf_counter() - start)
        return loaded

    def _intact_prefix(self, keys: list[bytes], found: dict) -> list:
        good = []
        for key in keys:
            block = found.get(key)
            if block is None:
                break
            if not is_intact(block, self.blocks.dtype_name, self.blocks.block_shape, self.mac_key):
                with self._stats_lock:
                    self.stats.blocks_refused += 1
                logger.warning(
                    "KV block …%s is damaged, forged or of another model shape; computing it instead.",
                    key.hex()[-16:],
                )
                break
            good.append(block)
        return good

    def _count(self, kind: str, num_blocks: int, seconds: float) -> None:
        """Add one transfer (``kind`` "save" or "load") to the totals and log it."""
        nbytes = num_blocks * self.blocks.block_nbytes
        s = self.stats
        with self._stats_lock:
            if kind == "save":
                s.blocks_saved += num_blocks
                s.bytes_saved += nbytes
                s.save_s += seconds
            else:
                s.blocks_loaded += num_blocks
                s.bytes_loaded += nbytes
                s.load_s += seconds
        done = "saved" if kind == "save" else "loaded"
        logger.info("KV %s: %d blocks, %.1f MiB in %.1f ms", done, num_blocks, nbytes / 2**20, seconds * 1e3)
