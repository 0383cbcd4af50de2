"""The real default model with the Triton backend forced (interpreted on CPU): the same greedy tokens as torch.

A step budget of 8 tokens splits the prompts into chunks, so the steps mix
a prefill chunk over cached context with decodes, as serving does.
"""

from __future__ import annotations

import pytest
import torch

import kernels.paged_attention
from protocol import SamplingParams
from services.llm import LLM

pytestmark = pytest.mark.slow

ENGINE = dict(
    num_threads=1,
    dtype="float32",
    max_model_len=128,
    num_gpu_blocks_override=32,
    max_num_seqs=4,
    max_num_batched_tokens=8,
)
PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def greedy_tokens(monkeypatch, backend: str, device: torch.device) -> list[list[int]]:
    monkeypatch.setenv("WEFT_ATTENTION_BACKEND", backend)
    llm = LLM(None, device=device.type, **ENGINE)  # on CUDA, the Triton run replays decode CUDA graphs
    try:
        assert llm.config.device.attention_backend == backend
        return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_triton_backend_gives_the_torch_greedy_tokens(monkeypatch, device):
    torch.set_num_threads(1)
    expected = greedy_tokens(monkeypatch, "torch", device)
    calls = []
    kernel = kernels.paged_attention.paged_attention
    monkeypatch.setattr(
        kernels.paged_attention, "paged_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k)
    )
    assert greedy_tokens(monkeypatch, "triton", device) == expected
    assert (
        len(calls) >= 30 * 2
    )  # every layer of every eager step ran the kernel (graph replays call no Python)
    assert all(len(tokens) == 3 for tokens in expected)
