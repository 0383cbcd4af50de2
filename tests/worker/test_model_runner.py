"""The model runner on the real default model, driven by hand-made SchedulerOutputs."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
PROMPT = [
    1,
    504,
    3458,
    282,
    4649,
    314,
    253,
    1345,
    2752,
    28,
    657,
    7160,
    30,
    1000,
    2000,
    3000,
    400,
    500,
    600,
    700,
    13,
    33,
    44,
    55,
    66,
    77,
    88,
    99,
    111,
    222,
    333,
    444,
    555,
    666,
    777,
    888,
    999,
]


class Scheduler:
    """Just enough of a scheduler: sequential block allocation and token bookkeeping."""

    def __init__(self, runner, first_block: int = 1) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.next_block = first_block
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}

    def _allocate(self, req_id: str, upto: int) -> list[int]:
        need = -(-upto // self.block_size) - len(self.blocks[req_id])
        new = list(range(self.next_block, self.next_block + max(0, need)))
        self.next_block += len(new)
        self.blocks[req_id] += new
        return new

    def step(self, scheduled: dict[str, int], new: dict[str, tuple] | None = None, finished=(), preempted=()):
        """``new`` maps req_id -> (prompt, params, computed, shared_blocks, outputs)."""
        new_reqs, cached = [], CachedRequestData([], [], [])
        for req_id, (prompt, params, computed, shared, outputs) in (new or {}).items():
            self.blocks[req_id], self.computed[req_id] = list(shared), computed
            self.tokens[req_id], self.outputs[req_id] = list(prompt) + list(outputs), list(outputs)
            self._allocate(req_id, computed + scheduled[req_id])
            new_reqs.append(
                NewRequestData(
                    req_id, list(prompt), params, list(self.blocks[req_id]), computed, list(outputs)
                )
            )
        for req_id, n in scheduled.items():
            if req_id in (new or {}):
                continue
            cached.req_ids.append(req_id)
            cached.new_block_ids.append(self._allocate(req_id, self.computed[req_id] + n))
            cached.num_computed_tokens.append(self.computed[req_id])
        out = self.runner.execute_model(
            SchedulerOutput(
                new_reqs, cached, dict(scheduled), sum(scheduled.values()), list(finished), list(preempted)
            )
        )
        for req_id, n in scheduled.items():
            self.computed[req_id] += n
        for req_id, sampled in zip(out.req_ids, out.sampled_token_ids):
            self.tokens[req_id] += sampled
            self.outputs[req_id] += sampled
        return out

    def decode(self, req_ids: list[str], steps: int) -> None:
        for _ in range(steps):
            self.step({r: 1 for r in req_ids})


@pytest.fixture
def sched(smollm_runner):
    s = Scheduler(smollm_runner)
    yield s
    smollm_runner.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, list(s.blocks)))
    assert len(smollm_runner.input_batch) == 0


def test_three_chunks_give_the_same_next_token_as_one(sched):
    n = len(PROMPT)
    first = sched.step(
        {"whole": n, "chunked": 10},
        new={"whole": (PROMPT, GREEDY, 0, [], ()), "chunked": (PROMPT, GREEDY, 0, [], ())},
    )
    assert first.req_ids == ["whole", "chunked"]
    assert first.sampled_token_ids[1] == []  # mid-prefill
    assert sched.step({"chunked": 17}).sampled_token_ids == [[]]
    last = sched.step({"chunked": n - 27})
    assert last.sampled_token_ids == [sched.outputs["whole"]]
    sched.decode(["whole", "chunked"], 6)
    assert sched.outputs["chunked"] == sched.outputs["whole"]


def test_decodes_continue_the_dense_forward(sched, smollm_runner, run_dense):
    sched.step({"a": len(PROMPT)}, new={"a": (PROMPT, GREEDY, 0, [], ())})
    sched.decode(["a"], 5)
    dense = run_dense(smollm_runner.model, sched.tokens["a"][:-1])
    assert dense[len(PROMPT) - 1 :].argmax(-1).tolist() == sched.outputs["a"]


def test_prefix_cache_hit_reads_shared_blocks(sched):
    sched.step({"owner": len(PROMPT)}, new={"owner": (PROMPT, GREEDY, 0, [], ())})
    shared = sched.blocks["owner"][:2]  # two full blocks = 32 cached tokens
    sched.step({"hit": len(PROMPT) - 32}, new={"hit": (PROMPT, GREEDY, 32, shared, ())})
    sched.decode(["owner", "hit"], 4)
    assert sched.outputs["hit"] == sched.outputs["owner"]


def test_preempted_request_recomputes_and_continues(sched):
    sched.step(
        {"steady": len(PROMPT), "victim": len(PROMPT)},
        new={r: (PROMPT, GREEDY, 0, [], ()) for r in ("steady", "victim")},
    )
    sched.decode(["steady", "victim"], 3)
    so_far = list(sched.outputs["victim"])
    resumed = (PROMPT, GREEDY, 0, [], so_far)
    sched.step(
        {"steady": 1, "victim": len(PROMPT) + len(so_far)}, new={"victim": resumed}, preempted=["victim"]
    )
    sched.decode(["steady", "victim"], 3)
    assert sched.outputs["victim"] == sched.outputs["steady"]


def test_prompt_logprobs_cover_every_prompt_token_across_chunks(sched, smollm_runner, run_dense):
    params = SamplingParams(temperature=0.0, prompt_logprobs=2, logprobs=3)
    first = sched.step({"p": 20}, new={"p": (PROMPT, params, 0, [], ())})
    second = sched.step({"p": len(PROMPT) - 20})
    entries = first.prompt_logprobs["p"] + second.prompt_logprobs["p"]
    assert len(entries) == len(PROMPT) and entries[0] is None
    raw = run_dense(smollm_runner.model, PROMPT).log_softmax(-1)
    for pos in (1, 19, 20, len(PROMPT) - 1):
        entry = entries[pos]
        assert entry.token_ids[0] == PROMPT[pos] and len(entry.token_ids) == 3
        assert entry.logprobs[0] == pytest.approx(float(raw[pos - 1, PROMPT[pos]]), abs=1e-4)
    (sampled,) = second.logprobs[0]
    assert sampled.rank == 1 and sampled.token_ids[0] == second.sampled_token_ids[0][0]


def test_seeded_random_requests_repeat_across_batches(sched):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=64)
    sched.step({"s1": len(PROMPT)}, new={"s1": (PROMPT, seeded, 0, [], ())})
    sched.decode(["s1"], 4)
    other = SamplingParams(temperature=0.8, top_p=0.9)
    sched.step(
        {"s2": len(PROMPT), "noise": 5},
        new={"s2": (PROMPT, seeded, 0, [], ()), "noise": (PROMPT[:5], other, 0, [], ())},
    )
    sched.decode(["noise", "s2"], 4)
    assert sched.outputs["s2"] == sched.outputs["s1"]


def test_decode_step_time_64_sequences(sched, smollm_runner):
    """Prints (does not assert) one decode step of 64 sequences with ~300 tokens of context."""
    rng = np.random.default_rng(0)
    context, n = 300, 64
    new = {
        f"t{i}": (rng.integers(100, 40000, context).tolist(), GREEDY, context - 1, [], ()) for i in range(n)
    }
    sched.step({r: 1 for r in new}, new=new)  # context is pretend-cached; only the timing matters
    times = []
    for _ in range(3):
        start = time.perf_counter()
        sched.decode(list(new), 1)
        times.append(time.perf_counter() - start)
    print(
        f"\ndecode step, {n} sequences x ~{context} tokens of context, "
        f"{torch.get_num_threads()} thread(s): {min(times) * 1000:.0f} ms (best of 3)"
    )
    assert all(len(sched.outputs[r]) == 4 for r in new)


def test_cpu_sampling_profile_runs_the_lm_head_on_few_rows_and_samples_all(smollm_runner, monkeypatch):
    """The CPU start-up profile runs the LM head on CPU_PROFILE_LOGIT_ROWS rows, yet the sampler
    gets logits of the step's every row, so their bytes count in the peak."""
    from services.worker.worker import CPU_PROFILE_LOGIT_ROWS

    runner = smollm_runner
    head_rows, sampled = [], []
    compute_logits, sampler = runner.model.compute_logits, runner.sampler
    monkeypatch.setattr(
        runner.model, "compute_logits", lambda h: head_rows.append(h.shape[0]) or compute_logits(h)
    )
    monkeypatch.setattr(
        runner, "sampler", lambda logits, meta: sampled.append(tuple(logits.shape)) or sampler(logits, meta)
    )
    runner.profile_sampling(CPU_PROFILE_LOGIT_ROWS)
    rows = min(runner.config.scheduler.max_num_seqs, runner.config.scheduler.max_num_batched_tokens)
    assert rows > CPU_PROFILE_LOGIT_ROWS
    assert head_rows == [CPU_PROFILE_LOGIT_ROWS]
    assert sampled == [(rows, runner.model.args.vocab_size)]
    head_rows.clear(), sampled.clear()
    runner.profile_sampling()  # without the row count, as on a GPU: the LM head over every row
    assert head_rows == [rows] and sampled == [(rows, runner.model.args.vocab_size)]
