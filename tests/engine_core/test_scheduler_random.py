"""Random workloads: whatever the config, every request ends right and nothing leaks.

FakeWorker checks the KV contents each step, so prefix hits, chunking and
preemption are all held to "the model saw exactly this request's tokens".
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from protocol import FinishReason
from services.engine_core.request import RequestStatus
from services.engine_core.scheduler import catch_up_end
from tests.engine_core.fakes import FakeWorker, make_request, make_scheduler, step, tokens_of

MAX_MODEL_LEN = 96
BLOCK = 16

request_spec = st.fixed_dictionaries(
    {
        "base": st.integers(0, 1),  # requests with the same base share a prefix
        "shared": st.integers(0, 64),
        "own": st.integers(1, 12),
        "max_tokens": st.integers(1, 24),
        "priority": st.integers(0, 3),
        "salt": st.sampled_from([None, "s"]),
        "arrives": st.integers(0, 6),  # step at which it is added
        "abort_at": st.one_of(st.none(), st.integers(0, 30)),
    }
)

config_spec = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(MAX_MODEL_LEN // BLOCK + 1, 16),
        "scheduling_policy": st.sampled_from(["fcfs", "priority", "shortest-first"]),
        "enable_chunked_prefill": st.booleans(),
        "max_num_batched_tokens": st.integers(8, 128),
        "max_num_seqs": st.integers(1, 6),
        "long_prefill_token_threshold": st.sampled_from([0, 8, 24]),
        "max_num_partial_prefills": st.sampled_from([1, 2, 3]),
        "prefill_tokens_beside_decodes": st.sampled_from([0, 4, 16]),
        "caching": st.booleans(),
    }
)


def _prompt(index: int, spec: dict) -> list[int]:
    shared = [spec["base"] * 1000 + j for j in range(spec["shared"])]
    own = [50_000 + index * 100 + j for j in range(spec["own"])]
    return shared + own


@settings(max_examples=150, deadline=None)
@given(config=config_spec, specs=st.lists(request_spec, min_size=2, max_size=8))
def test_random_workloads_finish_correctly_without_leaks(config, specs):
    if not config["enable_chunked_prefill"]:
        # Without chunking a whole prompt must fit one step (vLLM requires the same).
        config["max_num_batched_tokens"] = max(config["max_num_batched_tokens"], MAX_MODEL_LEN)
    s = make_scheduler(max_model_len=MAX_MODEL_LEN, block_size=BLOCK, **config)
    w = FakeWorker(BLOCK)
    requests, outputs, preemptions, hits = {}, {}, 0, 0
    for step_index in range(3000):
        for i, spec in enumerate(specs):
            if spec["arrives"] == step_index:
                r = make_request(
                    s,
                    f"r{i}",
                    _prompt(i, spec),
                    priority=spec["priority"],
                    cache_salt=spec["salt"],
                    max_tokens=spec["max_tokens"],
                )
                s.add_request(r)
                requests[r.request_id] = r
            if spec["abort_at"] == step_index:
                s.finish_requests(f"r{i}", RequestStatus.FINISHED_ABORTED)
        if step_index > 6 and not s.has_unfinished_requests():
            break
        decoding = any(r.num_computed_tokens >= r.num_prompt_tokens for r in s.running)
        # Catch-up: the prompt, and a resumed request's outputs but its newest (catch_up_end).
        ends = {rid: catch_up_end(r) for rid, r in requests.items()}
        so, step_outputs = step(s, w)
        if decoding and config["prefill_tokens_beside_decodes"] and config["enable_chunked_prefill"]:
            # Where each scheduled request starts, prefix-cache hits included.
            cached = so.scheduled_cached_reqs
            start = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            start.update((r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs)
            catch_up_tokens = sum(n for rid, n in so.num_scheduled_tokens.items() if start[rid] < ends[rid])
            assert catch_up_tokens <= config["prefill_tokens_beside_decodes"]
        preemptions += len(so.preempted_req_ids)
        hits += sum(n.num_computed_tokens > 0 for n in so.scheduled_new_reqs)
        for output in step_outputs:
            outputs.setdefault(output.request_id, []).append(output)
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.all_blocks_free()
    # Shown by --hypothesis-show-statistics: how often the hard paths ran.
    event(f"preempted: {preemptions > 0}")
    event(f"prefix hit: {hits > 0}")

    for i, spec in enumerate(specs):
        r = requests[f"r{i}"]
        got = outputs.get(r.request_id, [])
        limit = min(spec["max_tokens"], MAX_MODEL_LEN - r.num_prompt_tokens)
        if r.status == RequestStatus.FINISHED_ABORTED:
            assert len(tokens_of(got)) < limit and all(not o.finished for o in got)
            continue
        assert tokens_of(got) == [1000 + k for k in range(limit)]
        assert [o.finish_reason for o in got if o.finished] == [FinishReason.LENGTH]
        assert got[-1].finished
