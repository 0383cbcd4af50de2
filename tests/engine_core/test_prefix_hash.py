from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from protocol import SamplingParams
from protocol.block_hashes import NONE_HASH, hash_block_tokens
from services.engine_core.prefix_hash import make_block_hasher
from services.engine_core.request import Request

BLOCK = 4


HASHER = make_block_hasher(BLOCK)


def request(prompt, salt=None, hasher=HASHER) -> Request:
    return Request("r", prompt, SamplingParams(), 0.0, cache_salt=salt, block_hasher=hasher)


def test_hash_is_sha256_sized_and_depends_on_every_input():
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == 32
    assert h == hash_block_tokens(NONE_HASH, (1, 2, 3, 4))  # None parent means NONE_HASH
    assert h != hash_block_tokens(None, [1, 2, 3, 5])
    assert h != hash_block_tokens(b"x" * 32, [1, 2, 3, 4])
    assert h != hash_block_tokens(None, [1, 2, 3, 4], ("salt",))


def test_hashes_are_the_same_in_another_process():
    code = (
        "from protocol.block_hashes import NONE_HASH, hash_block_tokens;"
        "print(NONE_HASH.hex(), hash_block_tokens(None, [7, 8], ('s',)).hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
        cwd=Path(__file__).resolve().parents[2],
    ).stdout.split()
    assert out == [NONE_HASH.hex(), hash_block_tokens(None, [7, 8], ("s",)).hex()]


def test_hasher_covers_full_blocks_only_and_chains():
    r = request(list(range(10)))  # two full blocks, two tokens left over
    assert len(r.block_hashes) == 2
    first = hash_block_tokens(None, [0, 1, 2, 3])
    assert r.block_hashes == [first, hash_block_tokens(first, [4, 5, 6, 7])]


def test_output_tokens_extend_the_hashes_as_blocks_fill():
    r = request(list(range(10)))
    r.append_output_token_ids(10)
    assert len(r.block_hashes) == 2
    r.append_output_token_ids([11, 12])
    assert len(r.block_hashes) == 3
    assert r.block_hashes == request(list(range(13))).block_hashes


def test_cache_salt_is_an_extra_key_of_the_first_block_only():
    plain, salted = request(list(range(8))), request(list(range(8)), salt="tenant-a")
    assert salted.block_hashes[0] == hash_block_tokens(None, [0, 1, 2, 3], ("tenant-a",))
    assert salted.block_hashes[1] == hash_block_tokens(salted.block_hashes[0], [4, 5, 6, 7])
    # Through the chain, every block differs from the unsalted one.
    assert all(p != s for p, s in zip(plain.block_hashes, salted.block_hashes))


def test_no_hasher_means_no_hashes():
    assert request(list(range(8)), hasher=None).block_hashes == []
    with pytest.raises(ValueError):
        make_block_hasher(0)
