"""Disaggregated prefill/decode in the scheduler, with hand-made worker reports.

``TransferWorker`` wraps the fake worker: it runs each step's plan at once
(saves copy the token ids held in the blocks to a dict standing in for the
store; loads write them back), reports them in the step's output, and lets a
test hold reports back or damage the store. The fake worker underneath still
checks that every position a request reads holds that request's own token,
so a wrong load or a block freed too early fails the test.
"""

from __future__ import annotations

import msgspec
import pytest

from protocol import SchedulerOutput
from protocol.kv_transfer import KVTransferConfig, KVTransferParams
from services.engine_core.request import RequestStatus
from services.engine_core.scheduler import Scheduler
from services.kv_transfer.block_connector import block_namespace
from tests.engine_core.fakes import FakeWorker, make_config, make_request, run_to_completion, step

BS = 16


def make(role: str, connector: str = "ZmqConnector", num_blocks: int = 64, **extra) -> Scheduler:
    kv = KVTransferConfig(kv_connector=connector, kv_role=role, kv_connector_extra_config=extra)
    return Scheduler(msgspec.structs.replace(make_config(block_size=BS), kv_transfer=kv), num_blocks)


class TransferWorker:
    def __init__(self, store: dict[bytes, list[int]] | None = None) -> None:
        self.worker = FakeWorker(BS)
        self.store = {} if store is None else store
        self.hold_sends = False  # keep finished saves unreported
        self.num_loads = 0

    def execute(self, so: SchedulerOutput):
        out = self.worker.execute(so)
        meta = so.kv_connector_metadata
        if meta is None:
            return out
        for save in meta.saves:
            for block_id, block_hash in zip(save.block_ids, save.block_hashes):
                # A prompt's partial last block has slots no forward wrote: they travel as None.
                self.store[block_hash] = [self.worker.kv.get(block_id * BS + i) for i in range(BS)]
            if not self.hold_sends:
                out.finished_sending.append(save.req_id)
        for load in meta.loads:
            self.num_loads += 1
            out.finished_recving[load.req_id] = self._load(load.block_ids, load.block_hashes)
        return out

    def _load(self, block_ids: list[int], block_hashes: list[bytes]) -> int:
        for n, (block_id, block_hash) in enumerate(zip(block_ids, block_hashes)):
            if block_hash not in self.store:
                return n
            for i, token in enumerate(self.store[block_hash]):
                if token is not None:
                    self.worker.kv[block_id * BS + i] = token
        return len(block_ids)


def decode_request(
    scheduler: Scheduler, request_id: str, prompt: list[int], remote_num_tokens: int, **kwargs
):
    params = KVTransferParams(do_remote_prefill=True, remote_num_tokens=remote_num_tokens)
    request = make_request(scheduler, request_id, prompt, **kwargs)
    request.kv_transfer_params = params
    scheduler.add_request(request)
    return request


def prefill_request(scheduler: Scheduler, request_id: str, prompt: list[int]):
    request = make_request(scheduler, request_id, prompt, max_tokens=1)
    request.kv_transfer_params = KVTransferParams(do_remote_decode=True)
    scheduler.add_request(request)
    return request


PROMPT = list(range(700, 760))  # 60 tokens: 3 full blocks and 11 tokens of a 4th a consumer may load
SENT = 59  # every prompt token but the last, which the consumer computes to sample


def produce(store: dict, prompt=PROMPT) -> KVTransferParams:
    """Run a producer on ``prompt``; returns the params its response carries."""
    producer, worker = make("kv_producer"), TransferWorker(store)
    prefill_request(producer, "p", prompt)
    outputs = run_to_completion(producer, worker)
    (last,) = outputs["p"]
    return last.kv_transfer_params


# ---- producer


def test_producer_keeps_the_blocks_until_they_are_saved_and_hands_on_the_params():
    s, w = make("kv_producer"), TransferWorker()
    w.hold_sends = True
    prefill_request(s, "p", PROMPT)
    _, outputs = step(s, w)
    (out,) = outputs
    assert out.finished and out.kv_transfer_params == KVTransferParams(
        do_remote_prefill=True, remote_num_tokens=SENT
    )
    assert s.has_unfinished_requests() and not s.kv_cache_manager.all_blocks_free()
    so, _ = step(s, w)  # an empty step carries the save plan to the worker
    assert so.is_empty and [t.req_id for t in so.kv_connector_metadata.saves] == ["p"]
    assert len(so.kv_connector_metadata.saves[0].block_ids) == 4 and len(w.store) == 4  # the partial too
    w.hold_sends = False
    so, _ = step(s, w)  # still polling: the save is in flight
    assert so.kv_connector_metadata is not None and not so.kv_connector_metadata.saves
    s.update_from_output(s.schedule(), _report(sent=["p"]))
    assert not s.has_unfinished_requests() and s.kv_cache_manager.all_blocks_free()


def test_producer_frees_the_blocks_when_no_save_is_reported_in_time():
    s, w = make("kv_producer"), TransferWorker()
    w.hold_sends = True
    s.kv_transfer.hold_timeout_s = 0.0
    prefill_request(s, "p", PROMPT)
    step(s, w)
    step(s, w)  # the hold has expired by this step's report
    assert s.kv_cache_manager.all_blocks_free()


def test_an_aborted_request_hands_nothing_on():
    s, w = make("kv_producer"), TransferWorker()
    prefill_request(s, "p", PROMPT * 2)
    s.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests() and s.kv_cache_manager.all_blocks_free()
    step(s, w)
    assert not w.store


def test_kv_both_saves_only_what_the_proxy_marked():
    s, w = make("kv_both"), TransferWorker()
    s.add_request(make_request(s, "plain", PROMPT, max_tokens=1))
    outputs = run_to_completion(s, w)
    assert outputs["plain"][-1].kv_transfer_params is None and not w.store


# ---- consumer


def test_consumer_loads_the_announced_blocks_and_computes_only_the_rest():
    store: dict = {}
    params = produce(store)
    s, w = make("kv_consumer"), TransferWorker(store)
    decode_request(s, "d", PROMPT, params.remote_num_tokens, max_tokens=4)
    so, outputs = step(s, w)  # parked: nothing scheduled, the plan loads 3 full blocks and the partial one
    assert so.is_empty and not outputs
    (load,) = so.kv_connector_metadata.loads
    assert len(load.block_ids) == 4 and load.wait_s > 0
    so, first = step(s, w)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == SENT and so.num_scheduled_tokens == {"d": 1}  # one token computed
    outputs = first + run_to_completion(s, w)["d"]
    assert outputs[-1].num_cached_tokens == SENT and len([t for o in outputs for t in o.new_token_ids]) == 4


def test_other_requests_run_while_one_waits_for_its_kv():
    store: dict = {}
    params = produce(store)
    s = make("kv_consumer")
    decode_request(s, "d", PROMPT, params.remote_num_tokens)
    s.add_request(make_request(s, "other", 20))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"other": 20}
    assert s.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert s.get_request_counts() == (1, 1)
    stats = s.make_stats()
    assert (stats.num_waiting_reqs, stats.external_prefix_cache_queries) == (1, SENT)


def test_external_hits_are_counted_once_loaded():
    store: dict = {}
    params = produce(store)
    s, w = make("kv_consumer"), TransferWorker(store)
    decode_request(s, "d", PROMPT, params.remote_num_tokens)
    step(s, w)
    assert s.make_stats().external_prefix_cache_hits == SENT
    run_to_completion(s, w)


def test_a_short_load_leaves_more_to_compute():
    store: dict = {}
    params = produce(store)
    del store[sorted(store)[0]]  # any missing block cuts the chain where it is
    s, w = make("kv_consumer"), TransferWorker(store)
    decode_request(s, "d", PROMPT, params.remote_num_tokens)
    step(s, w)
    so, _ = step(s, w)
    computed = so.scheduled_new_reqs[0].num_computed_tokens
    assert computed in (0, 16, 32, 48) and so.num_scheduled_tokens["d"] == 60 - computed
    run_to_completion(s, w)


def test_a_failed_load_recomputes_the_whole_prompt_and_does_not_retry():
    s, w = make("kv_consumer"), TransferWorker({})  # nothing was ever saved
    decode_request(s, "d", PROMPT, 48)
    step(s, w)
    so, _ = step(s, w)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0 and so.num_scheduled_tokens == {"d": 60}
    run_to_completion(s, w)
    assert w.num_loads == 1


def test_a_request_aborted_while_loading_keeps_its_blocks_until_the_load_ends():
    s = make("kv_consumer")
    decode_request(s, "d", PROMPT, 48)
    so = s.schedule()  # parked: the load is now in flight at the worker
    s.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert s.has_unfinished_requests() and not s.kv_cache_manager.all_blocks_free()
    s.update_from_output(so, _report(received={"d": 0}))
    assert not s.has_unfinished_requests() and s.kv_cache_manager.all_blocks_free()


def test_loaded_blocks_serve_later_requests_as_local_prefix_hits():
    store: dict = {}
    params = produce(store)
    s, w = make("kv_consumer"), TransferWorker(store)
    decode_request(s, "d", PROMPT, params.remote_num_tokens)
    run_to_completion(s, w)
    s.add_request(make_request(s, "again", PROMPT))  # no params: a plain request
    so, _ = step(s, w)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 48 and so.kv_connector_metadata is None
    run_to_completion(s, w)


def test_prompt_logprobs_requests_are_computed_not_loaded():
    store: dict = {}
    params = produce(store)
    s, w = make("kv_consumer"), TransferWorker(store)
    decode_request(s, "d", PROMPT, params.remote_num_tokens, prompt_logprobs=1)
    so, _ = step(s, w)
    assert so.num_scheduled_tokens == {"d": 60}
    run_to_completion(s, w)


def test_shared_storage_finds_saved_blocks_without_params(tmp_path):
    s = make("kv_consumer", "SharedStorageConnector", shared_storage_path=str(tmp_path))
    request = make_request(s, "d", PROMPT)
    namespace = block_namespace(make_config(block_size=BS))
    for block_hash in request.block_hashes[:2]:
        (tmp_path / f"{(namespace + block_hash).hex()}.safetensors").touch()
    s.add_request(request)
    so = s.schedule()
    (load,) = so.kv_connector_metadata.loads
    assert len(load.block_ids) == 2 and load.wait_s == 0.0  # found, so no waiting for a producer


def test_without_a_connector_nothing_changes():
    s = Scheduler(make_config(block_size=BS), 64)
    s.add_request(make_request(s, "r", PROMPT))
    assert s.schedule().kv_connector_metadata is None


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_plain_requests_run_as_usual_under_either_role(role):
    s, w = make(role), TransferWorker()
    s.add_request(make_request(s, "r", PROMPT, max_tokens=3))
    outputs = run_to_completion(s, w)
    assert len([t for o in outputs["r"] for t in o.new_token_ids]) == 3


def _report(sent=(), received=None):
    from protocol import ModelRunnerOutput

    return ModelRunnerOutput(finished_sending=list(sent), finished_recving=dict(received or {}))


def test_requests_back_from_their_loads_keep_arrival_order_ahead_of_later_ones():
    store: dict = {}
    prompts = [PROMPT, list(range(800, 860))]
    params = [produce(store, prompt) for prompt in prompts]
    kv = KVTransferConfig(kv_connector="ZmqConnector", kv_role="kv_consumer")
    s = Scheduler(msgspec.structs.replace(make_config(block_size=BS, max_num_seqs=3), kv_transfer=kv), 64)
    w = TransferWorker(store)
    for request_id, prompt, p in zip(("d1", "d2"), prompts, params):
        decode_request(s, request_id, prompt, p.remote_num_tokens)
    for request_id in ("late-1", "late-2", "late-3", "late-4"):  # the first three fill the seats
        s.add_request(make_request(s, request_id, 4, max_tokens=50))
    step(s, w)  # d1 and d2 park off the queue and load (reported in this step); late-4 has no seat
    assert [r.request_id for r in s.waiting] == ["d1", "d2", "late-4"]


def test_a_request_aborted_while_loading_gets_its_blocks_back_when_the_load_never_reports():
    s = make("kv_consumer")
    s.kv_transfer.abandon_timeout_s = 0.0
    decode_request(s, "d", PROMPT, 48)
    so = s.schedule()  # parked: the load is now in flight at the worker, which never answers
    s.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert not s.kv_cache_manager.all_blocks_free()
    s.update_from_output(so, _report())  # a step with no report for "d": its deadline has passed
    assert not s.has_unfinished_requests() and s.kv_cache_manager.all_blocks_free()
    assert s.schedule().kv_connector_metadata is None  # nothing left to wait for
    s.update_from_output(so, _report(received={"d": 48 // BS}))  # a late report changes nothing
    assert s.kv_cache_manager.all_blocks_free()


def test_the_abandon_timeout_outlasts_any_load_the_worker_may_still_write():
    assert make("kv_consumer").kv_transfer.abandon_timeout_s == 120.0
    slow = make("kv_consumer", timeout_s=100.0)  # a load may write until 2 x 100 s after submission
    assert slow.kv_transfer.abandon_timeout_s > 2 * 100.0


def test_an_older_producers_whole_blocks_load_as_before():
    """Announced tokens that stop at a block boundary (no partial block sent): those blocks only."""
    store: dict = {}
    produce(store)
    s, w = make("kv_consumer"), TransferWorker(store)
    decode_request(s, "d", PROMPT, 48)
    so, _ = step(s, w)
    assert len(so.kv_connector_metadata.loads[0].block_ids) == 3
    so, _ = step(s, w)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 48 and so.num_scheduled_tokens == {"d": 12}
    run_to_completion(s, w)


@pytest.mark.parametrize("length", [2, 10, 17, 33])
def test_prompts_of_any_length_hand_on_all_but_their_last_token(length):
    """A prompt shorter than a block, or one token past a boundary, still sends its partial block."""
    store: dict = {}
    prompt = list(range(900, 900 + length))
    params = produce(store, prompt)
    assert params.remote_num_tokens == length - 1 and len(store) == -(-(length - 1) // BS)
    s, w = make("kv_consumer"), TransferWorker(store)
    decode_request(s, "d", prompt, params.remote_num_tokens, max_tokens=3)
    step(s, w)
    so, _ = step(s, w)
    assert so.scheduled_new_reqs[0].num_computed_tokens == length - 1 and so.num_scheduled_tokens == {"d": 1}
    run_to_completion(s, w)  # the fake worker checks every position read holds this request's token


def test_a_partial_block_is_named_by_its_prefix_and_its_own_tokens():
    from services.kv_transfer.block_connector import partial_block_hash

    s = make("kv_consumer")
    a, b = make_request(s, "a", PROMPT), make_request(s, "b", PROMPT[:-3] + [1, 2, 3])
    assert partial_block_hash(a, BS, 59) != partial_block_hash(b, BS, 59)  # the partial tokens differ
    assert partial_block_hash(a, BS, 56) == partial_block_hash(b, BS, 56)  # the same first 56 tokens
    assert partial_block_hash(a, BS, 48) is None  # whole blocks: no partial one
    assert partial_block_hash(a, BS, 59) not in a.block_hashes
