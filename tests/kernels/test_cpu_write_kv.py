"""``write_kv``, the compiled write of a step's keys and values into a cache of their dtype, against
its twin (``write_kv_cache_ref``, ``index_copy_``'s result) bit for bit, and the arguments it refuses."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kernels import cpu_attention
from kernels.reference import write_kv_cache_ref
from tests.kernels.test_cpu_attention import _CountOps
from tests.kernels.test_cpu_attention_int8 import write_case

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the CPU kernel with"
)


def float_case(gen, num_tokens, num_kv_heads, head_dim, dtype, num_blocks=40, block_size=16):
    """``write_case``'s keys, values and slots (views of a fused QKV output), with a cache of their
    dtype full of a marker value."""
    key, value, _, _, slots = write_case(
        gen, num_tokens, num_kv_heads, head_dim, dtype, num_blocks, block_size
    )
    cache = torch.full((2, num_kv_heads, num_blocks, block_size, head_dim), -3.5, dtype=dtype)
    return key, value, cache, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 5, 1500])  # a decode; one thread; parallel over tokens
@pytest.mark.parametrize("head_dim", [64, 256, 3])
def test_write_matches_the_twin_bit_for_bit(dtype, num_tokens, head_dim):
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    key, value, cache, slots = float_case(gen, num_tokens, 3, head_dim, dtype, num_blocks=100)
    assert num_tokens == 1 or key.stride(0) > key.shape[1] * key.shape[2]  # rows of a fused QKV output
    slots[1::7] = -1  # skipped tokens
    got, want = cache.clone(), cache.clone()
    cpu_attention.write_kv(key, value, got, slots)
    write_kv_cache_ref(key, value, want, slots)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # NaN payloads included
    # What the twin wrote is the rows themselves, and nothing else changed.
    keep = slots >= 0
    rows = got.view(2, 3, -1, head_dim)
    assert torch.equal(rows[0][:, slots[keep]].transpose(0, 1), key[keep])
    assert torch.equal(rows[1][:, slots[keep]].transpose(0, 1), value[keep])
    untouched = torch.ones(rows.shape[2], dtype=torch.bool)
    untouched[slots[keep]] = False
    assert torch.all(rows[:, :, untouched] == -3.5)


def bad_inputs():
    gen = torch.Generator().manual_seed(2)
    key, value, cache, slots = float_case(gen, 6, 2, 64, torch.bfloat16, num_blocks=4)
    good = dict(key=key, value=value, kv_cache=cache, slot_mapping=slots)
    past = slots.clone()
    past[2] = cache.shape[2] * cache.shape[3]
    return good, [
        (dict(slot_mapping=past), "slot_mapping entries must be below"),
        (dict(slot_mapping=slots.int()), "int64"),
        (dict(kv_cache=cache.float()), "kv_cache must be a contiguous"),
        (dict(kv_cache=cache.to(torch.int8)), "kv_cache must be a contiguous"),
        (dict(value=value.float()), "one dtype"),
        (
            dict(key=key.double(), value=value.double(), kv_cache=cache.double()),
            "float32, bfloat16 or float16",
        ),
        (dict(key=key[:, :1]), "must match"),
        (dict(key=key.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous in the head dimension"),
        (dict(kv_cache=cache[:, :1]), "(must match|KV heads)"),
        (dict(kv_cache=cache.transpose(2, 3)), "contiguous"),
    ]


@pytest.mark.parametrize("case", range(len(bad_inputs()[1])))
@pytest.mark.parametrize("check", [True, False])  # the Python checks, or the kernel's own
def test_bad_arguments_get_a_clear_error(case, check):
    good, cases = bad_inputs()
    change, message = cases[case]
    args = good | change
    before = args["kv_cache"].clone()
    with pytest.raises((ValueError, RuntimeError), match=message if check or case == 0 else None) as raised:
        cpu_attention.write_kv(**args, check=check)
    assert raised.type is ValueError
    assert torch.equal(args["kv_cache"], before)  # nothing half-written


def test_the_python_checks_run_no_tensor_op():
    good, _ = bad_inputs()
    with _CountOps() as counted:
        cpu_attention.check_write_kv_args(**good)
    assert counted.ops == []
