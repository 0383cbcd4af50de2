"""A connector that moves whole KV blocks, named by their prefix hashes,
through a ``BlockStore``; the two connectors differ only in the store.

Producer: when a request ends normally, the KV of every prompt token but the
last (which the consumer must compute to sample) is saved, as vLLM's
connectors do: its full blocks under ``namespace + block hash``, and the last,
partial block (if the tokens do not fill whole blocks) under a hash of its
parent and its own tokens (``partial_block_hash``); the request's response
says how many tokens that covers. The scheduler keeps the blocks until the worker reports
the save done.

Consumer: a request with ``do_remote_prefill`` claims the announced tokens
past its local prefix hit (the partial block too when all but its last
prompt token are announced: it then computes one token); a discoverable store (files) is also probed for
requests that announce nothing. The claim is always asynchronous: the
request waits in WAITING_FOR_REMOTE_KVS while the worker's transfer thread
fetches the blocks, waiting up to ``timeout_s`` for a producer that is still
writing them. Whatever does not arrive intact is computed.

The namespace (a digest of the checkpoint, dtype and block size,
``namespace.block_namespace``) keeps engines that serve different models
from reading each other's blocks under equal token hashes. With a keys
folder (``keys_dir``), blocks are sealed with a keyed MAC and the ZMQ link
is CurveZMQ (``keys``).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any

from protocol import EngineConfig, SchedulerOutput
from protocol.block_hashes import hash_block_tokens
from protocol.kv_transfer import KVBlockTransfer, KVConnectorMetadata, KVTransferParams
from services.config.kv_transfer_args import connector_options
from services.kv_transfer.base import KVConnectorBase, KVConnectorRole
from services.kv_transfer.block_store import BlockStore
from services.kv_transfer.keys import mac_key
from services.kv_transfer.namespace import block_namespace

if TYPE_CHECKING:
    import torch

    from services.kv_transfer.transfer_thread import TransferThread

# Request statuses (services.engine_core.request.RequestStatus) by name: a
# request that ended on its own has complete prompt KV worth handing on.
_SAVED_ENDINGS = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


# In a partial block's hash only: it never equals a full block's.
_PARTIAL = "weft: a prompt's last, partial block"

__all__ = ["BlockConnector", "block_namespace", "partial_block_hash"]


def partial_block_hash(request: Any, block_size: int, num_tokens: int) -> bytes | None:
    """The name of the block that holds tokens ``[num_tokens // block_size * block_size,
    num_tokens)`` of ``request``, when ``num_tokens`` does not fill whole blocks (else None):
    its parent full block's hash chained with its own tokens, as a full block's is."""
    num_full, rest = divmod(num_tokens, block_size)
    if rest == 0 or len(request.block_hashes) < num_full:
        return None
    parent = request.block_hashes[num_full - 1] if num_full else None
    salt = (request.cache_salt,) if num_full == 0 and request.cache_salt is not None else ()
    tokens = request.all_token_ids[num_full * block_size : num_tokens]
    return hash_block_tokens(parent, tokens, (_PARTIAL, *salt))


class BlockConnector(KVConnectorBase):
    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.options = connector_options(self.kv_config)
        self.namespace = block_namespace(config)
        keys_dir = self.options.keys_dir
        self.mac_key = None if keys_dir is None else mac_key(keys_dir)
        # Scheduler side: the next plan, and the requests the workers have
        # not reported back on yet.
        self._loads: list[KVBlockTransfer] = []
        self._saves: list[KVBlockTransfer] = []
        self._in_flight: set[str] = set()
        # Scheduler side probes discoverable stores; the worker's store lives on its thread.
        self._probe: BlockStore | None = None
        self._thread: TransferThread | None = None

    @abstractmethod
    def _make_store(self) -> BlockStore:
        """A new store client (one per thread that uses it)."""

    def key_of(self, block_hash: bytes) -> bytes:
        return self.namespace + block_hash

    # ------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.kv_config.is_consumer or request.sampling_params.prompt_logprobs is not None:
            return 0, False  # prompt logprobs need every prompt position computed
        # The last prompt token is always computed: its logits give the first output.
        num_tokens = request.num_tokens - 1
        max_blocks = min(num_tokens // self.block_size, len(request.block_hashes))
        announced = self._announced_tokens(request)
        num_blocks = min(announced // self.block_size, max_blocks)
        loadable = num_blocks * self.block_size
        partial = partial_block_hash(request, self.block_size, num_tokens)
        if num_blocks == 0 and (probe := self._store_for_probing()) is not None:
            num_blocks = probe.num_present([self.key_of(h) for h in request.block_hashes[:max_blocks]])
            loadable = num_blocks * self.block_size
            if num_blocks == num_tokens // self.block_size and partial is not None:
                loadable += (num_tokens - loadable) * probe.num_present([self.key_of(partial)])
        elif announced == num_tokens and num_blocks == num_tokens // self.block_size and partial is not None:
            loadable = num_tokens  # the partial block as well: everything but the last token
        num_external = loadable - num_computed_tokens
        return (num_external, True) if num_external > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        first = request.num_computed_tokens // self.block_size
        end = request.num_computed_tokens + num_external_tokens
        last = end // self.block_size
        ids, hashes = block_ids[first:last], list(request.block_hashes[first:last])
        if (partial := partial_block_hash(request, self.block_size, end)) is not None:
            ids.append(block_ids[last])
            hashes.append(partial)
        # Announced blocks may still be on their way: wait for them; found ones are there.
        wait_s = self.options.timeout_s if self._announced_tokens(request) else 0.0
        self._loads.append(KVBlockTransfer(request.request_id, ids, hashes, wait_s))
        self._in_flight.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        if not (self._loads or self._saves or self._in_flight):
            return None
        metadata = KVConnectorMetadata(loads=self._loads, saves=self._saves)
        self._loads, self._saves = [], []
        return metadata

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, KVTransferParams | None]:
        if not self._should_save(request):
            return False, None
        num_tokens = request.num_prompt_tokens - 1  # the consumer computes the last one, to sample
        num_blocks = min(num_tokens // self.block_size, len(block_ids), len(request.block_hashes))
        ids, hashes = block_ids[:num_blocks], list(request.block_hashes[:num_blocks])
        num_sent = num_blocks * self.block_size
        partial = partial_block_hash(request, self.block_size, num_tokens)
        if (
            partial is not None
            and num_blocks == num_tokens // self.block_size
            and len(block_ids) > num_blocks
        ):
            ids.append(block_ids[num_blocks])
            hashes.append(partial)
            num_sent = num_tokens
        if not ids:
            return False, KVTransferParams(do_remote_prefill=True, remote_num_tokens=0)
        self._saves.append(KVBlockTransfer(request.request_id, ids, hashes))
        self._in_flight.add(request.request_id)
        return True, KVTransferParams(do_remote_prefill=True, remote_num_tokens=num_sent)

    def update_connector_output(self, finished_sending: list[str], finished_recving: dict[str, int]) -> None:
        self._in_flight.difference_update(finished_sending)
        self._in_flight.difference_update(finished_recving)

    def forget(self, request_id: str) -> None:
        self._in_flight.discard(request_id)

    def _should_save(self, request: Any) -> bool:
        if not self.kv_config.is_producer or request.status.name not in _SAVED_ENDINGS:
            return False
        params = request.kv_transfer_params
        # A pure producer hands on every prompt; kv_both only those the proxy marked.
        return self.kv_config.kv_role == "kv_producer" or (params is not None and params.do_remote_decode)

    @staticmethod
    def _announced_tokens(request: Any) -> int:
        params = request.kv_transfer_params
        return params.remote_num_tokens if params is not None and params.do_remote_prefill else 0

    def _store_for_probing(self) -> BlockStore | None:
        if self._probe is None:
            store = self._make_store()
            if not store.discoverable:
                store.close()
                return None
            self._probe = store
        return self._probe

    # ------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        from services.kv_transfer.kv_blocks import PagedKVBlocks
        from services.kv_transfer.transfer_thread import TransferThread

        self._thread = TransferThread(
            self._make_store(),
            PagedKVBlocks(kv_caches),
            self.key_of,
            mac_key=self.mac_key,
            make_store=self._make_store,
            max_concurrent=self.options.max_concurrent,
            timeout_s=self.options.timeout_s,
        )

    @property
    def transfer_stats(self):
        return None if self._thread is None else self._thread.stats

    def start_load_kv(self) -> None:
        # Saves start here too, not after the forward: their blocks belong to
        # requests that already finished (the scheduler keeps the blocks
        # until the save is reported), and a consumer may be waiting for them.
        for transfer in self.connector_metadata.saves:
            self._worker_thread().submit("save", transfer)
        for transfer in self.connector_metadata.loads:
            self._worker_thread().submit("load", transfer)

    def wait_for_save(self) -> None:
        """Nothing to wait for: saves read held blocks no forward writes."""

    def get_finished(self, wait_s: float = 0.0) -> tuple[list[str], dict[str, int]]:
        return self._worker_thread().take_finished(wait_s)

    def _worker_thread(self) -> TransferThread:
        assert self._thread is not None, "register_kv_caches first"
        return self._thread

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.close()
            self._thread = None
        if self._probe is not None:
            self._probe.close()
            self._probe = None
