"""The runner's speculative step: verification in chunks of whole requests."""

from __future__ import annotations

import msgspec
import pytest
import torch

from protocol import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SamplingParams,
    SchedulerConfig,
    SpeculativeConfig,
)
from services.worker.input_batch import CachedRequestState
from services.worker.spec_decode.spec_decoder import SpecDecoder, request_chunks


def test_chunks_hold_whole_requests_within_the_row_limit() -> None:
    drafts = [[1, 2], [3], [], [4, 5, 6, 7]]  # 3, 2, 1 and 5 rows
    assert request_chunks(drafts, 5) == [(0, 2), (2, 3), (3, 4)]
    assert request_chunks(drafts, 100) == [(0, 4)]
    assert request_chunks([[1, 2, 3, 4]], 2) == [(0, 1)]  # one request never splits
    assert request_chunks([], 3) == []


def decoder(max_num_seqs: int) -> SpecDecoder:
    config = EngineConfig(
        model=ModelConfig(
            model="x.gguf",
            tokenizer="x",
            served_model_name="x",
            dtype="float32",
            max_model_len=256,
            vocab_size=40,
            eos_token_id=0,
        ),
        cache=CacheConfig(),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
    )
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    return SpecDecoder(
        msgspec.structs.replace(config, speculative=spec),
        torch.Generator().manual_seed(0),
        torch.device("cpu"),
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=0.9, top_k=10, seed=11),
    ],
)
def test_chunked_verification_equals_one_pass(params: SamplingParams) -> None:
    states = [CachedRequestState(f"r{i}", i, [1, 2, 3], params, [4 + i]) for i in range(6)]
    drafts = [[5, 6, 7], [], [8], [9, 10], [11, 12, 13], [14]]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), 40, generator=torch.Generator().manual_seed(2))
    # Make the drafts likely: each draft token gets a head start.
    row = 0
    for d in drafts:
        for j, token in enumerate(d):
            logits[row + j, token] += 4.0
        row += len(d) + 1
    whole = decoder(max_num_seqs=64)
    chunked = decoder(max_num_seqs=2)
    assert chunked.max_chunk_rows == 4 and whole.max_chunk_rows == 64
    assert chunked._verify(logits, states, drafts) == whole._verify(logits, states, drafts)
