"""The engine core's scheduler: which tokens of which requests run next.

There are no prefill and decode phases. Each step hands out one token
budget: first to RUNNING requests (decodes and unfinished prefill chunks),
then to WAITING ones, so that every request's ``num_computed_tokens``
catches up with its ``num_tokens``. When the KV pool runs dry, running
requests are preempted by recompute: their blocks are freed and they wait
again at the front of the queue.

With async scheduling (``async_scheduling.py``) a request is scheduled again
while its previous step runs: the token that step samples is an output
placeholder until its output comes back.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from protocol import (
    CachedRequestData,
    EngineConfig,
    EngineCoreEventType,
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
)
from protocol.engine import ITERATION_TOKENS_BUCKETS
from protocol.kv_cache_groups import group_windows
from protocol.kv_transfer import KVTransferParams
from services.engine_core.kv_cache_manager import GroupBlocks, KVCacheManager
from services.engine_core.kv_transfer_scheduling import KVTransferScheduling
from services.engine_core.partial_prefills import PartialPrefillLimits, PrefillCount
from services.engine_core.prefix_hash import make_block_hasher
from services.engine_core.request import Request, RequestStatus
from services.engine_core.request_queue import create_request_queue
from services.engine_core.spec_decode import SpecDecodeScheduling
from services.engine_core.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class _StepPlan:
    """What one ``schedule()`` call has decided so far."""

    budget: int
    prefills: PrefillCount  # partial and long prefills so far
    # Prompt tokens the step may still take, all prompts together (None: the budget's): set where
    # the step carries requests past their prompt and the config bounds prompts beside them.
    prefill_room: int | None = None
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)  # the worker does not hold them
    cached_reqs: list[Request] = field(default_factory=list)  # the worker holds them
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    new_group_block_ids: dict[str, list[list[int]]] = field(default_factory=dict)  # KV cache groups 1..
    preempted: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # drafts to verify

    def add(self, request: Request, num_tokens: int, new_blocks: GroupBlocks, is_new: bool) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.budget -= num_tokens
        (self.new_reqs if is_new else self.cached_reqs).append(request)
        self.new_block_ids[request.request_id] = [b.block_id for b in new_blocks]
        self.new_group_block_ids[request.request_id] = [
            [b.block_id for b in g] for g in new_blocks.groups[1:]
        ]

    def clamp_prefill(self, request: Request, num_computed: int, num_new: int) -> int:
        """``num_new`` of ``request``'s tokens from ``num_computed`` on, fewer where they are
        catch-up tokens past the room."""
        if self.prefill_room is None or num_computed >= catch_up_end(request):
            return num_new
        return min(num_new, self.prefill_room)

    def take_prefill(self, request: Request, num_computed: int, num_tokens: int) -> None:
        if self.prefill_room is not None and num_computed < catch_up_end(request):
            self.prefill_room -= num_tokens

    def drop(self, request: Request) -> None:
        """Undo ``add`` for a running request preempted later in the same step."""
        num_tokens = self.num_scheduled_tokens.pop(request.request_id, None)
        if num_tokens is None:
            return
        self.take_prefill(request, request.num_computed_tokens, -num_tokens)
        self.budget += num_tokens
        self.cached_reqs.remove(request)
        del self.new_block_ids[request.request_id]
        del self.new_group_block_ids[request.request_id]
        self.spec_tokens.pop(request.request_id, None)


def catch_up_end(request: Request) -> int:
    """Where a request's catch-up ends: its prompt, and after a preemption the outputs it computes
    again, all but the newest token (the input of its next decode). The room for prompt tokens
    beside decodes (``_StepPlan.prefill_room``) bounds the tokens a step schedules below it: a
    resumed request whose prompt is cached costs its neighbours as much as a prompt would."""
    return max(request.num_prompt_tokens, request.num_tokens - 1)


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set a finished status after the newest output token if it ends the request."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if params.stop_token_ids and last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    # min_tokens <= max_tokens, so only the model's length can end a request
    # before min_tokens: its positions would not exist.
    if request.num_tokens >= max_model_len or (
        params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        sched = config.scheduler
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.long_prefill_token_threshold = sched.long_prefill_token_threshold
        self.prefill_tokens_beside_decodes = sched.prefill_tokens_beside_decodes
        self.enable_chunked_prefill = sched.enable_chunked_prefill
        self.policy = sched.scheduling_policy
        self.prefill_limits = PartialPrefillLimits(
            sched.max_num_partial_prefills,
            sched.max_long_partial_prefills,
            sched.long_prefill_token_threshold,
        )
        self.max_model_len = config.model.max_model_len
        self.num_blocks = num_blocks

        caching = config.cache.enable_prefix_caching
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.cache.block_size, caching, self.max_model_len, group_windows(config.model)
        )
        # Handed to Request.from_engine_core_request; None when no prefix is shared.
        self.block_hasher = make_block_hasher(config.cache.block_size) if caching else None

        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished since the previous schedule(); ordered for reproducible outputs.
        self.finished_req_ids: dict[str, None] = {}
        self._num_preemptions = 0  # since the previous make_stats()
        self.spec_decode = SpecDecodeScheduling(config.speculative, self.max_model_len)
        # Disaggregated prefill/decode: KV loaded from / handed to other engines.
        self.kv_transfer = KVTransferScheduling(config, self.kv_cache_manager)
        self.structured_output_manager = StructuredOutputManager(config)
        # Constrained requests whose grammar compiles; they join `waiting` when it is done.
        self.waiting_for_grammar: list[Request] = []
        self._error_outputs: list[EngineCoreOutput] = []  # failed outside a step's outputs
        # Requeued by fail_step: the worker must drop what it holds of them (next step's output).
        self._failed_step_preempted: list[str] = []
        self._step_counter = 0
        # Tokens per step since the previous make_stats(), bucketed (see SchedulerStats).
        self._iteration_counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self._iteration_sum = 0
        # Paused (the API's /pause): schedule() hands out nothing; requests keep their place.
        self.paused = False
        self.async_scheduling = sched.async_scheduling

    # ----------------------------------------------------------- requests in

    def add_request(self, request: Request) -> None:
        # The prompt was validated by EngineCore.validate_request (and the API before it).
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use.")
        request.status = RequestStatus.WAITING
        request.record_event(EngineCoreEventType.QUEUED)
        self.requests[request.request_id] = request
        if request.sampling_params.structured_outputs is not None:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.structured_output_manager.add_request(request)
            self.waiting_for_grammar.append(request)
        else:
            self.waiting.add(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (aborts); unknown or finished ids are ignored."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"status must be a finished one, got {status!r}.")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        queued = []
        for request_id in dict.fromkeys(request_ids):
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                queued.append(request)
            request.status = status
            self._free_request(request)
        self.waiting.remove_requests(queued)

    def has_unfinished_requests(self) -> bool:
        return (
            bool(self.running)
            or bool(self.waiting)
            or bool(self.waiting_for_grammar)
            or self.kv_transfer.has_pending()
        )

    def get_request_counts(self) -> tuple[int, int]:
        """(num_running, num_waiting), the load an engine core reports."""
        return len(self.running), (
            len(self.waiting) + len(self.waiting_for_grammar) + len(self.kv_transfer.waiting_for_remote)
        )

    # -------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(
            budget=0 if self.paused else self.max_num_batched_tokens,
            prefills=PrefillCount(self.prefill_limits),
            prefill_room=self._prefill_room(),
        )
        self._admit_compiled_grammars()
        self.structured_output_manager.filter_drafts(self.running)
        if self.waiting and self.waiting.peek().suspect:
            # After a step that failed to allocate, each of its requests runs one step
            # alone: the one that fails again alone is the one that caused it.
            self._schedule_waiting(plan)
        else:
            self._schedule_running(plan)
            # After a preemption the pool is known to be short: admitting new
            # work now would only preempt again next step.
            if not plan.preempted:
                self._schedule_waiting(plan)
        output = self._make_output(plan)
        if self._failed_step_preempted:
            output.preempted_req_ids += self._failed_step_preempted
            self._failed_step_preempted = []
        self._attach_grammar_bitmask(output)
        self.kv_transfer.build_connector_meta(output)
        # Advance now, so the next schedule() sees these tokens as computed
        # even before their outputs come back.
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num_tokens
            if (
                self.async_scheduling
                and not request.is_pooling
                and request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders
            ):
                request.num_output_placeholders += 1  # it samples: the token is known after the step
        self.finished_req_ids = {}
        self._step_counter += 1
        self._count_iteration_tokens(output.total_num_scheduled_tokens)
        return output

    def _count_iteration_tokens(self, num_tokens: int) -> None:
        if num_tokens == 0:
            return  # nothing ran: not an engine step a user would count
        self._iteration_counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
        self._iteration_sum += num_tokens

    def _prefill_room(self) -> int | None:
        """The step's room for prompt tokens: ``prefill_tokens_beside_decodes`` where a running
        request is past its prompt (its next token waits on this step), else the budget's. Only
        with chunked prefill: without it a prompt runs whole or waits."""
        if (
            self.prefill_tokens_beside_decodes
            and self.enable_chunked_prefill
            and any(r.num_computed_tokens >= r.num_prompt_tokens for r in self.running)
        ):
            return self.prefill_tokens_beside_decodes
        return None

    def _schedule_running(self, plan: _StepPlan) -> None:
        index = 0
        while index < len(self.running) and plan.budget > 0:
            request = self.running[index]
            num_drafts = self.spec_decode.num_schedulable_drafts(request)
            if request.num_output_placeholders and self._waits_for_its_token(request):
                index += 1
                continue
            num_new = (
                request.num_tokens
                + request.num_output_placeholders
                + num_drafts
                - request.num_computed_tokens
            )
            num_new = self._clamp_to_budget(self._clamp_chunk(num_new), request.num_computed_tokens, plan)
            num_new = plan.clamp_prefill(request, request.num_computed_tokens, num_new)
            if num_new == 0:
                # Its sampled token is not back yet; others may still run.
                index += 1
                continue
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            while new_blocks is None:
                victim = self._pick_victim()
                if self.running.index(victim) < index:
                    index -= 1
                self._preempt(victim, plan)
                if victim is request:
                    # Everyone left outranks it (priority) or is ahead of
                    # it (fcfs): the step's running pass ends here.
                    return
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            plan.add(request, num_new, new_blocks, is_new=False)
            plan.take_prefill(request, request.num_computed_tokens, num_new)
            plan.prefills.add(request.num_tokens - request.num_computed_tokens, num_new)
            if num_drafts:
                drafts = self.spec_decode.scheduled_drafts(request, num_new)
                if drafts:
                    plan.spec_tokens[request.request_id] = drafts
            index += 1

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        # Held back by the partial-prefill limits: back at the front, in order, when the pass ends.
        passed_over: list[Request] = []
        try:
            self._admit_waiting(plan, passed_over)
        finally:
            for request in reversed(passed_over):
                self.waiting.prepend(request)

    def _admit_waiting(self, plan: _StepPlan, passed_over: list[Request]) -> None:
        while self.waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            if plan.prefill_room == 0:
                break  # the step's prompt tokens are taken
            request = self.waiting.peek()
            if request.suspect and plan.num_scheduled_tokens:
                break  # a suspect of a failed step runs alone
            # A request back from a remote KV load already holds its blocks.
            hit_blocks, num_hit_tokens = (
                ([], 0) if request.num_computed_tokens else self.kv_cache_manager.get_computed_blocks(request)
            )
            num_external = self.kv_transfer.num_external_tokens(request, num_hit_tokens)
            if num_external:
                if not self.kv_transfer.park(request, hit_blocks, num_hit_tokens, num_external):
                    break
                self.waiting.pop()  # it waits for its KV off the queue
                continue
            num_computed = request.num_computed_tokens + num_hit_tokens
            num_left = request.num_tokens - num_computed
            num_new = self._clamp_chunk(num_left)
            if not self.enable_chunked_prefill and num_new > plan.budget:
                break  # wait for a step with room, keeping arrival order
            num_new = self._clamp_to_budget(num_new, num_computed, plan)
            num_new = plan.clamp_prefill(request, num_computed, num_new)
            if not plan.prefills.admits(num_left, num_new):
                passed_over.append(self.waiting.pop())
                if len(passed_over) >= self.max_num_seqs:
                    break  # a bounded look past the queue's head per step
                continue
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new, num_hit_tokens, hit_blocks)
            if new_blocks is None:
                break
            self.waiting.pop()
            self._admit(request, num_computed)
            plan.add(request, num_new, new_blocks, is_new=True)
            plan.take_prefill(request, num_computed, num_new)
            plan.prefills.add(num_left, num_new)
            if request.suspect:
                break  # alone

    def _waits_for_its_token(self, request: Request) -> bool:
        """Async scheduling: a request with a step in flight is not scheduled ahead when
        its grammar's next mask needs that step's token, or when that token ends it by length
        (its next token would only be thrown away)."""
        if request.structured_output is not None:
            return True
        num_outputs = request.num_output_tokens + request.num_output_placeholders
        max_tokens = request.sampling_params.max_tokens
        return (max_tokens is not None and num_outputs >= max_tokens) or (
            request.num_tokens + request.num_output_placeholders >= self.max_model_len
        )

    def _clamp_chunk(self, num_new: int) -> int:
        if self.long_prefill_token_threshold > 0:
            return min(num_new, self.long_prefill_token_threshold)
        return num_new

    def _clamp_to_budget(self, num_new: int, num_computed: int, plan: _StepPlan) -> int:
        # The max_model_len bound is a safety net: add_request and the stop
        # checks already keep num_tokens below it.
        return min(num_new, plan.budget, self.max_model_len - num_computed)

    def _admit(self, request: Request, num_hit_tokens: int) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        request.record_event(EngineCoreEventType.SCHEDULED)
        self.running.append(request)

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            # Largest priority value is least important; later arrival loses ties.
            return max(self.running, key=lambda r: (r.priority, r.arrival_order))
        return self.running[-1]  # fcfs: the most recently admitted

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        """Recompute-style preemption: drop the KV, queue again at the front."""
        plan.drop(request)
        self._requeue_at_front(request)
        plan.preempted.append(request)

    def _requeue_at_front(self, request: Request) -> None:
        """Out of the running batch, its KV freed, first in the waiting queue to be computed again."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.record_event(EngineCoreEventType.PREEMPTED)
        self._num_preemptions += 1
        self.waiting.prepend(request)

    def _make_output(self, plan: _StepPlan) -> SchedulerOutput:
        block_ids = self.kv_cache_manager.get_block_ids
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                sampling_params=r.sampling_params,
                block_ids=block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                # Non-empty only for a resumed request: the worker dropped it.
                output_token_ids=list(r.output_token_ids),
                group_block_ids=self.kv_cache_manager.get_group_block_ids(r.request_id),
                pooling_params=r.pooling_params,
            )
            for r in plan.new_reqs
        ]
        cached = CachedRequestData(
            req_ids=[r.request_id for r in plan.cached_reqs],
            new_block_ids=[plan.new_block_ids[r.request_id] for r in plan.cached_reqs],
            num_computed_tokens=[r.num_computed_tokens for r in plan.cached_reqs],
            new_group_block_ids=(
                [plan.new_group_block_ids[r.request_id] for r in plan.cached_reqs]
                if self.kv_cache_manager.num_groups > 1
                else []
            ),
        )
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(plan.num_scheduled_tokens),
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            finished_req_ids=list(self.finished_req_ids),
            preempted_req_ids=[r.request_id for r in plan.preempted],
            scheduled_spec_decode_tokens=dict(plan.spec_tokens),
        )

    # ------------------------------------------------- structured outputs

    def _admit_compiled_grammars(self) -> None:
        """Requests whose grammar compiled join the queue; a failed compile ends its request."""
        if not self.waiting_for_grammar:
            return
        ready, failed, self.waiting_for_grammar = self.structured_output_manager.split_compiled(
            self.waiting_for_grammar
        )
        for request in ready:
            request.status = RequestStatus.WAITING
            self.waiting.requeue(request)
        for request, error in failed:
            self._finish_with_error(request, error)

    def _attach_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """Token masks of the constrained requests that sample this step."""
        scheduled = [self.requests[request_id] for request_id in output.num_scheduled_tokens]
        output.structured_output_request_ids, output.grammar_bitmask = (
            self.structured_output_manager.grammar_bitmask(
                scheduled, output.num_scheduled_tokens, output.scheduled_spec_decode_tokens
            )
        )

    def _grammar_ends(self, request: Request, token_id: int) -> bool:
        """Advance a constrained request's grammar; True once it ended (or refused)."""
        if request.structured_output is None:
            return False
        ended = self.structured_output_manager.accept_token(request, token_id)
        if request.status == RequestStatus.FINISHED_ERROR:
            # The mask should have forbidden that token: the engine's fault, not the client's.
            request.error_is_internal = True
        return ended

    # ------------------------------------------------------- a failed step

    def fail_step(self, scheduler_output: SchedulerOutput, reason: str) -> None:
        """The step failed to allocate memory (the worker's state is unchanged past
        the requests it was handed). A request alone in the step caused it and
        fails (a 500 at the API); one in a step with others goes back to the queue
        to recompute, a suspect that runs its next step alone -- unless it was in a
        failed step before (each request gets one retry, never more). Running
        requests the step did not hold are requeued too, so suspects run alone.
        Their outputs come with the next ``take_error_outputs``."""
        in_step = [
            self.requests[r]
            for r in scheduler_output.num_scheduled_tokens
            if r in self.requests and not self.requests[r].is_finished
        ]
        alone = len(in_step) == 1
        failed = []
        for request in in_step:
            request.num_failed_steps += 1
            if alone or request.num_failed_steps > 1:
                failed.append(request)
        for request in failed:
            self._remove_finished(request)
            request.error = (
                f"The engine could not allocate the memory to run this request "
                f"({reason}); it may be too long for this server."
            )
            request.error_is_internal = True
            self._finish_with_error(request, request.error, internal=True)
        # Back to the queue's front in the order they ran.
        for request in reversed(list(self.running)):
            request.suspect = request in in_step
            self._requeue_after_failure(request)
        # Blocks are published when allocated: the failed step's never got their KV.
        if not self.kv_cache_manager.reset_prefix_cache():
            logger.warning("The prefix cache could not be reset after a failed step (blocks in use).")

    def _finish_with_error(self, request: Request, error: str, internal: bool = False) -> None:
        """End ``request`` with ``error`` (a 5xx at the API when ``internal``), its blocks freed."""
        request.status = RequestStatus.FINISHED_ERROR
        self._free_request(request)
        self._error_outputs.append(
            EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                events=request.take_events(),
                error=error,
                error_is_internal=internal,
            )
        )

    def _requeue_after_failure(self, request: Request) -> None:
        self._requeue_at_front(request)
        self._failed_step_preempted.append(request.request_id)

    def take_error_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests that failed outside a step's results (fail_step)."""
        outputs, self._error_outputs = self._error_outputs, []
        return outputs

    # ----------------------------------------------------------- outputs back

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        model_runner_output: ModelRunnerOutput,
        scheduled_requests: dict[str, Request] | None = None,
    ) -> list[EngineCoreOutput]:
        """Apply a step's sampled tokens. ``scheduled_requests`` (async scheduling): the
        Request objects that step ran, so a later request reusing a finished id is left alone."""
        index_of = {req_id: i for i, req_id in enumerate(model_runner_output.req_ids)}
        first_positions = _first_positions(scheduler_output)
        pooled_rows = {req_id: i for i, req_id in enumerate(model_runner_output.pooled_req_ids)}
        outputs, self._error_outputs = self._error_outputs, []
        for resumed in self.kv_transfer.update_from_output(model_runner_output):
            self.waiting.requeue(resumed)  # its remote KV load ended
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue  # aborted after it was scheduled (or, async, stopped by the step before)
            if scheduled_requests is not None and scheduled_requests.get(request_id) is not request:
                continue
            request.suspect = False  # its step ran: it may share steps again
            # Async scheduling: a request preempted while this step ran still takes its token.
            first_position = first_positions[request_id]
            self.spec_decode.apply_output(
                request,
                scheduler_output.scheduled_spec_decode_tokens.get(request_id, []),
                index_of.get(request_id),
                model_runner_output,
            )
            if request.is_pooling:
                output = self._process_pooled(request, pooled_rows.get(request_id), model_runner_output)
            else:
                output = self._process_one(
                    request, index_of.get(request_id), first_position, model_runner_output
                )
            if output is not None:
                outputs.append(output)
        return outputs

    def _process_one(
        self,
        request: Request,
        index: int | None,
        first_position: int,
        runner_output: ModelRunnerOutput,
    ) -> EngineCoreOutput | None:
        sampled = runner_output.sampled_token_ids[index] if index is not None else []
        if sampled and request.num_output_placeholders:
            request.num_output_placeholders -= 1
        new_token_ids = []
        for token_id in sampled:
            request.append_output_token_ids(token_id)
            new_token_ids.append(token_id)
            if check_stop(request, self.max_model_len) or self._grammar_ends(request, token_id):
                break  # tokens after a stop are dropped
        prompt_logprobs = self._new_prompt_logprobs(request, first_position, runner_output)
        if not new_token_ids and prompt_logprobs is None:
            return None  # mid-prefill: nothing to report yet
        output = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=self._kept_logprobs(runner_output, index, len(new_token_ids)),
            new_prompt_logprobs=prompt_logprobs,
            finish_reason=request.get_finish_reason(),
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            events=request.take_events(),
            error=request.error,
            error_is_internal=request.error_is_internal,
        )
        if request.is_finished:
            self._remove_finished(request)
            output.kv_transfer_params = self._free_request(request)
        return output

    def _process_pooled(
        self, request: Request, row: int | None, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutput | None:
        """A pooling request ends with the step that ran its last prompt token: its vector goes
        out, its blocks back to the pool at once (nothing will read its KV again)."""
        if row is None:
            return None  # mid-prefill
        assert runner_output.pooled is not None, "a step with pooled rows carries their vectors"
        request.status = RequestStatus.FINISHED_STOPPED
        self._remove_finished(request)
        self._free_request(request)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=request.get_finish_reason(),
            num_cached_tokens=max(request.num_cached_tokens, 0),
            events=request.take_events(),
            pooled=runner_output.pooled[row],
        )

    def _remove_finished(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        else:  # async scheduling: preempted while its last step ran
            self.waiting.remove_requests([request])

    @staticmethod
    def _kept_logprobs(
        runner_output: ModelRunnerOutput, index: int | None, num_kept: int
    ) -> list[TokenLogprobs] | None:
        if index is None or index >= len(runner_output.logprobs) or num_kept == 0:
            return None
        return runner_output.logprobs[index][:num_kept] or None

    @staticmethod
    def _new_prompt_logprobs(
        request: Request, first_position: int, runner_output: ModelRunnerOutput
    ) -> list[TokenLogprobs | None] | None:
        """This step's prompt logprobs, less positions already sent.

        A chunk of tokens from ``first_position`` on scores the token after
        each of its own (a prompt's first chunk leads with None for position
        0), so its entries start at position ``first_position + 1``, or 0.
        A request preempted after some prefill recomputes its prompt from
        position 0; the front end must not see those positions twice.
        """
        entries = runner_output.prompt_logprobs.get(request.request_id)
        if not entries:
            return None
        start = first_position + 1 if first_position else 0
        skip = max(request.num_prompt_logprobs_sent - start, 0)
        end = start + len(entries)
        request.num_prompt_logprobs_sent = max(request.num_prompt_logprobs_sent, end)
        return entries[skip:] or None

    def _free_request(self, request: Request) -> KVTransferParams | None:
        """Forget a finished request; returns what another engine needs to
        take over its KV (a KV producer may keep its blocks until they are sent)."""
        free_now, kv_transfer_params = self.kv_transfer.request_finished(request)
        if free_now:
            self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids[request.request_id] = None
        return kv_transfer_params

    # ----------------------------------------------------------------- stats

    def make_stats(self) -> SchedulerStats:
        prefix = self.kv_cache_manager.take_prefix_cache_stats()
        num_preemptions, self._num_preemptions = self._num_preemptions, 0
        iteration_counts = self._iteration_counts if self._iteration_sum else []
        iteration_sum = self._iteration_sum
        self._iteration_counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self._iteration_sum = 0
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=(
                len(self.waiting) + len(self.waiting_for_grammar) + len(self.kv_transfer.waiting_for_remote)
            ),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            num_total_blocks=self.num_blocks - 1,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=num_preemptions,
            step_counter=self._step_counter,
            **self.spec_decode.take_stats(),
            **self.kv_transfer.take_stats(),
            structured_outputs=self.structured_output_manager.make_stats(),
            iteration_tokens_counts=iteration_counts,
            iteration_tokens_sum=iteration_sum,
        )


def _first_positions(scheduler_output: SchedulerOutput) -> dict[str, int]:
    """Each scheduled request's first position in the step (its computed tokens when scheduled)."""
    positions = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    positions.update(zip(cached.req_ids, cached.num_computed_tokens))
    return positions
