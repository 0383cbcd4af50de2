"""The Responses store: bounded by count and bytes, least recently used out first, per tenant."""

from __future__ import annotations

import msgspec
import pytest

from services.api.responses_schemas import InputItem, ResponseObject, StoredResponse
from services.api.responses_store import ResponsesStore


def entry(response_id: str, text: str = "x") -> StoredResponse:
    response = ResponseObject(id=response_id, created_at=0, model="m", status="completed")
    return StoredResponse(response, [InputItem(role="user", content=text)])


def size(e: StoredResponse) -> int:
    return len(msgspec.json.encode(e))


def test_the_least_recently_used_entry_leaves_first():
    store = ResponsesStore(max_entries=2)
    assert store.put("t", entry("a")) and store.put("t", entry("b"))
    assert store.get("t", "a") is not None  # a is now the most recently used
    store.put("t", entry("c"))
    assert store.get("t", "b") is None and store.get("t", "a") is not None and store.get("t", "c") is not None
    assert len(store) == 2


def test_the_byte_bound_evicts_until_the_new_entry_fits():
    big = entry("big", "y" * 1000)
    store = ResponsesStore(max_entries=100, max_bytes=size(big) + size(entry("a")))
    store.put("t", entry("a"))
    store.put("t", entry("b"))
    store.put("t", big)
    assert (
        store.get("t", "a") is None and store.get("t", "b") is not None and store.get("t", "big") is not None
    )
    assert store.num_bytes <= store.max_bytes
    assert not ResponsesStore(max_bytes=10).put("t", entry("a"))  # larger than the whole store


def test_tenants_do_not_see_each_others_entries():
    store = ResponsesStore()
    store.put("tenant-a", entry("r"))
    assert store.get("tenant-b", "r") is None and not store.delete("tenant-b", "r")
    assert store.get("tenant-a", "r").conversation[0].content == "x"
    assert store.delete("tenant-a", "r") and store.get("tenant-a", "r") is None and store.num_bytes == 0


def test_a_replaced_entry_is_counted_once():
    store = ResponsesStore()
    store.put("t", entry("r"))
    store.put("t", entry("r", "longer text"))
    assert len(store) == 1 and store.num_bytes == size(entry("r", "longer text"))


def test_a_zero_bound_turns_the_store_off():
    assert not ResponsesStore(max_entries=0).enabled
    with pytest.raises(ValueError):
        ResponsesStore(max_entries=-1)
