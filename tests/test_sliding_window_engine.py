"""Sliding-window attention through the whole engine, on a tiny random Gemma 3.

Cheap enough to push hard: a 16-token window over 16-token blocks, prompts
several windows long, 24-token steps (chunked prefill), shared prefixes
(prefix caching) and a pool too small for all requests (preemption).
Window blocks are released as requests move on; greedy tokens must still
match transformers' token for token.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from protocol import SamplingParams
from services import LLM, model_files
from services.api.tokenizer import Tokenizer
from tests.text_corpus import prompt_of_length

pytestmark = pytest.mark.slow

WINDOW = 16
NEW_TOKENS = 24
PROMPT_SHAPES = [(12, 300), (90, 0), (150, 500), (60, 0), (130, 0), (40, 900)]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    path = tmp_path_factory.mktemp("tiny-gemma3")
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=WINDOW,
        max_position_embeddings=512,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        initializer_range=0.2,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # Hugging Face starts Gemma's norms at 0 (a scale of 1): make them count
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    source = model_files.resolve(None).hf_dir
    for name in _TOKENIZER_FILES:
        shutil.copy(source / name, path / name)
    return path, model


@pytest.fixture(scope="module")
def prompts(tiny_gemma):
    tokenizer = Tokenizer(tiny_gemma[0])
    return [prompt_of_length(tokenizer, n, offset) for n, offset in PROMPT_SHAPES]


@pytest.fixture(scope="module")
def oracle(tiny_gemma, prompts):
    model = tiny_gemma[1]
    with torch.inference_mode():
        return [
            model.generate(
                torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )[0, len(p) :].tolist()
            for p in prompts
        ]


def run(folder, prompts, **engine_args):
    engine_args.setdefault("block_size", 16)  # the pools and windows below are counted in 16-token blocks
    llm = LLM(
        model=str(folder), dtype="float32", device="cpu", max_model_len=512, num_threads=1, **engine_args
    )
    executor, steps = llm.engine.executor, []
    original = executor.execute_model
    executor.execute_model = lambda out: (steps.append(out), original(out))[1]
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs], steps, llm.engine.scheduler.kv_cache_manager
    finally:
        llm.shutdown()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_matches_transformers_with_window_freeing(tiny_gemma, prompts, oracle, backend, monkeypatch):
    monkeypatch.setenv("WEFT_ATTENTION_BACKEND", backend)
    # 41 blocks: the fewest that hold one 512-token request (32 full-attention blocks, 4 for each
    # window group's window and step, the null block), far fewer than the six prompts together.
    outputs, steps, kv = run(tiny_gemma[0], prompts, max_num_batched_tokens=24, num_gpu_blocks_override=41)
    for i, (ours, expected) in enumerate(zip(outputs, oracle)):
        assert ours == expected, f"prompt {i} ({PROMPT_SHAPES[i]}) diverged"
    assert kv.windows == [None, WINDOW, WINDOW]  # 2 global + 4 window layers: groups of 2
    assert any(s.preempted_req_ids for s in steps), "the small pool should have forced preemption"
    assert any(
        0 in ids for s in steps for ids in s.scheduled_cached_reqs.new_group_block_ids for ids in ids
    ) or any(0 in r.group_block_ids[0] for s in steps for r in s.scheduled_new_reqs), (
        "window blocks should have been released (null entries) somewhere"
    )
    assert kv.all_blocks_free()


def test_prefix_hits_across_window_layers_stay_exact(tiny_gemma, prompts, oracle):
    # Prompt 4 shares its first 90 tokens with prompt 1 and its first 60 with prompt 3.
    order = [1, 3, 4]
    outputs, steps, kv = run(tiny_gemma[0], [prompts[i] for i in order], max_num_seqs=1)
    assert outputs == [oracle[i] for i in order]
    first_steps = {r.req_id: r.num_computed_tokens for s in steps for r in s.scheduled_new_reqs}
    assert max(first_steps.values()) >= 80  # prompt 4 started from a prefix hit
    assert kv.all_blocks_free()


def test_tensor_parallel_ranks_split_the_heads_and_keep_the_window(tiny_gemma, prompts, oracle):
    """TP=2: each rank holds 2 of the 4 query heads and a copy of the single KV head."""
    outputs, _, _ = run(tiny_gemma[0], prompts[1:3], tensor_parallel_size=2, max_num_batched_tokens=64)
    assert outputs == oracle[1:3]
