"""The Responses API's store: responses kept in the API process's memory, per API key.

Bounded by count and by bytes (the encoded JSON of each entry), least
recently used first out. Entries are keyed by (tenant, id), the tenant
being the digest of the API key that created it (``auth.tenant_of``), so
a client holding another key finds nothing, exactly as for an id that
never existed or was evicted. Entries are encoded bytes: what a caller
gets back is its own copy.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict

import msgspec

from services.api.responses_schemas import StoredResponse

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024

_decoder = msgspec.json.Decoder(StoredResponse)


class ResponsesStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("The responses store's bounds must be non-negative.")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self.num_bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tenant: str, entry: StoredResponse) -> bool:
        """Keep ``entry`` (evicting the least recently used); False if it alone is over the byte bound."""
        data = msgspec.json.encode(entry)
        if not self.enabled or len(data) > self.max_bytes:
            return False
        key = (tenant, entry.response.id)
        self._drop(key)
        while self._entries and (
            len(self._entries) >= self.max_entries or self.num_bytes + len(data) > self.max_bytes
        ):
            self._drop(next(iter(self._entries)))
        self._entries[key] = data
        self.num_bytes += len(data)
        return True

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        data = self._entries.get((tenant, response_id))
        if data is None:
            return None
        self._entries.move_to_end((tenant, response_id))
        return _decoder.decode(data)

    def delete(self, tenant: str, response_id: str) -> bool:
        return self._drop((tenant, response_id))

    def _drop(self, key: tuple[str, str]) -> bool:
        data = self._entries.pop(key, None)
        if data is None:
            return False
        self.num_bytes -= len(data)
        return True


def add_responses_store_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Responses API store")
    group.add_argument(
        "--responses-store-max-entries",
        type=int,
        default=DEFAULT_MAX_ENTRIES,
        help="Most responses kept for GET /v1/responses/{id} and previous_response_id, least recently "
        "used out first; 0 keeps none (then store: true is a 400) (default: %(default)s).",
    )
    group.add_argument(
        "--responses-store-max-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        help="Most bytes of kept responses (their JSON, conversations included) (default: %(default)s).",
    )


def responses_store_from(args: argparse.Namespace) -> ResponsesStore:
    return ResponsesStore(args.responses_store_max_entries, args.responses_store_max_bytes)
