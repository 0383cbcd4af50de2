"""DPLBEngineClient: the API's request client of N data-parallel engine cores.

It sends requests, aborts and utility calls to the ranks and routes their
outputs back to each request's stream. Which process serves each rank, and
whether it is ready, draining or dead, is ``RankMembership``'s
(``services/api/dp_membership.py``): it owns the sockets, the handshake,
the ranks' identities and lifecycle, and hands this client each live rank's
outputs (``on_outputs``) and each rank's death (``on_rank_dead``).

Requests go to the ready rank with the lowest ``rank_load``
(``4 * waiting + running``), as vLLM's DPLBAsyncMPClient does, or, with a
``PrefixRouter``, by the prefix each rank caches within a load bound
(``services/api/prefix_router.py``). A request whose rank dies fails with
``EngineDeadError`` (a 500); one for a rank whose connection is gone fails
at once, as the input socket is ROUTER_MANDATORY.
Torch-free: nothing here may import torch.
"""

from __future__ import annotations

import asyncio
import itertools
import subprocess
from collections.abc import AsyncGenerator, Sequence

from protocol import (
    EngineConfig,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
)
from protocol.curve import CurveKeys
from protocol.engine import UtilityMethod, UtilityRequest, UtilityResult
from services.api.dp_membership import LIVE, RankMembership
from services.api.engine_client import (
    DEFAULT_STEP_TIMEOUT_S,
    EngineClient,
    EngineDeadError,
    EngineNotReadyError,
    RankStats,
)
from services.api.engine_processes import LocalEngines, launch_local_engines
from services.api.prefix_router import PrefixRouter
from services.processes import stop_processes

__all__ = ["DPLBEngineClient", "launch_local_engines", "rank_load", "stop_processes"]

# An engine answers a utility call between two steps; a longer wait means it is stuck.
_UTILITY_TIMEOUT_S = 60.0

_Item = EngineCoreOutput | BaseException  # what a request's stream queue holds


def rank_load(stats: RankStats) -> int:
    """The balancer's load of a rank: a waiting request counts four running ones, as in vLLM."""
    return 4 * stats.num_waiting + stats.num_running


class DPLBEngineClient(EngineClient):
    def __init__(
        self,
        config: EngineConfig,
        handshake_address: str,
        num_ranks: int,
        local_processes: Sequence[subprocess.Popen[bytes]] = (),
        *,
        local_start_rank: int = 0,
        silence_timeout_s: float = 3.0,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        curve: CurveKeys | None = None,
        restart_local: bool = False,
        prefix_router: PrefixRouter | None = None,
        data_ports: tuple[int, int] = (0, 0),
    ) -> None:
        """The arguments are ``RankMembership``'s. With a ``prefix_router`` ranks are chosen
        by cached prefix and load, else by load alone."""
        self.members = RankMembership(
            config,
            handshake_address,
            num_ranks,
            self,
            local_processes,
            local_start_rank=local_start_rank,
            silence_timeout_s=silence_timeout_s,
            step_timeout_s=step_timeout_s,
            curve=curve,
            restart_local=restart_local,
            prefix_router=prefix_router,
            data_ports=data_ports,
        )
        self.prefix_router = prefix_router
        self._stats = self.members.stats
        self._queues: dict[str, asyncio.Queue[_Item]] = {}
        self._holder: dict[str, int] = {}  # request id -> the rank serving it
        # Utility calls sent and not answered: call id -> (rank, its answer).
        self._utility_calls: dict[int, tuple[int, asyncio.Future[UtilityResult]]] = {}
        self._call_ids = itertools.count()

    # ---- the membership's, read through

    @property
    def handshake_address(self) -> str:
        return self.members.handshake_address

    @property
    def input_address(self) -> str:
        return self.members.input_address

    @property
    def output_address(self) -> str:
        return self.members.output_address

    @property
    def local(self) -> LocalEngines:
        return self.members.local

    # Tests look at these two through the client.
    @property
    def _peer_host(self) -> dict[int, str | None]:
        return self.members.peer_host

    def _stuck_step(self, batch: EngineCoreOutputs) -> str | None:
        return self.members.stuck_step(batch)

    # ---- EngineClient

    async def start(self) -> None:
        await self.members.start()

    async def shutdown(self) -> None:
        await self.members.shutdown()

    @property
    def ready(self) -> bool:
        return self.members.ready

    def rank_stats(self) -> dict[int, RankStats]:
        return self._stats

    def dropped_frames(self) -> dict[str, int]:
        return self.members.dropped_frames()

    @property
    def max_model_len(self) -> int | None:
        return self.members.max_model_len

    @property
    def start_failure(self) -> str | None:
        return self.members.start_failure

    async def generate(self, request: EngineCoreRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        request_id = request.request_id
        if request_id in self._holder:
            raise ValueError(f"Request id {request_id!r} is already in flight.")
        rank = self._choose_rank(request)
        stats = self._stats[rank]
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._queues[request_id] = queue
        self._holder[request_id] = rank
        stats.in_flight.add(request_id)
        stats.num_routed += 1
        stats.num_waiting += 1  # counted until the rank's next stats replace it
        finished = False
        try:
            await self._send(rank, EngineCoreRequestType.ADD, request)
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            # The one ABORT of a request closed early (stop string, client gone).
            self._forget(request_id)
            if not finished and self._stats[rank].state in LIVE:
                await self._send(rank, EngineCoreRequestType.ABORT, [request_id])

    async def abort(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self._holder.get(request_id)
            if rank is not None:
                by_rank.setdefault(rank, []).append(request_id)
        for rank, ids in by_rank.items():
            for request_id in ids:
                self._finish_locally(
                    request_id,
                    EngineCoreOutput(
                        request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ABORT
                    ),
                )
            if self._stats[rank].state in LIVE:
                await self._send(rank, EngineCoreRequestType.ABORT, ids)

    async def call_utility(self, method: UtilityMethod) -> dict[int, bool]:
        ranks = self.members.live_ranks()
        if not ranks:
            raise EngineNotReadyError("No engine core is ready.")
        loop = asyncio.get_running_loop()
        calls = {next(self._call_ids): rank for rank in ranks}
        futures: dict[int, asyncio.Future[UtilityResult]] = {}
        try:
            for call_id, rank in calls.items():
                futures[rank] = loop.create_future()
                self._utility_calls[call_id] = (rank, futures[rank])
                await self._send(rank, EngineCoreRequestType.UTILITY, UtilityRequest(call_id, method))
            results = await asyncio.wait_for(asyncio.gather(*futures.values()), _UTILITY_TIMEOUT_S)
        finally:
            for call_id in calls:
                self._utility_calls.pop(call_id, None)
        answers = dict(zip(futures, results, strict=True))
        failed = [f"rank {rank}: {r.error}" for rank, r in answers.items() if r.error is not None]
        if failed:
            raise RuntimeError(f"{method.value} failed on " + "; ".join(failed))
        return {rank: r.ok for rank, r in answers.items()}

    # ---- RankListener

    def on_outputs(self, batch: EngineCoreOutputs) -> None:
        if batch.utility_output is not None:
            self._on_utility_result(batch.engine_index, batch.utility_output)
        for output in batch.outputs:
            self._route(output)

    def on_rank_dead(self, rank: int, reason: str) -> None:
        for request_id in list(self._stats[rank].in_flight):
            self._finish_locally(
                request_id,
                EngineDeadError(
                    f"Engine core rank {rank} stopped while serving request {request_id}: {reason}."
                ),
            )
        for held_by, future in self._utility_calls.values():
            if held_by == rank and not future.done():
                future.set_exception(EngineDeadError(f"Engine core rank {rank} stopped: {reason}."))

    # ---- routing

    def _choose_rank(self, request: EngineCoreRequest) -> int:
        if request.data_parallel_rank is not None:
            rank = request.data_parallel_rank
            if rank not in self._stats:
                raise ValueError(f"data_parallel_rank must be in [0, {self.members.num_ranks}), got {rank}.")
            if self._stats[rank].state != "ready":
                raise EngineNotReadyError(f"Data-parallel rank {rank} is {self._stats[rank].state}.")
            return rank
        loads = {s.rank: rank_load(s) for s in self._stats.values() if s.state == "ready"}
        if not loads:
            raise EngineNotReadyError("No engine core is ready.")
        if self.prefix_router is not None:
            return self.prefix_router.pick(request, loads)
        # Ties go to the lowest rank.
        return min(loads, key=lambda rank: (loads[rank], rank))

    async def _send(self, rank: int, kind: EngineCoreRequestType, payload: object = None) -> None:
        await self.members.send(rank, kind, payload)

    def _on_utility_result(self, rank: int, result: UtilityResult) -> None:
        pending = self._utility_calls.get(result.call_id)
        if pending is None or pending[0] != rank or pending[1].done():
            return  # a late answer to a call that timed out, or not ours
        pending[1].set_result(result)

    def _route(self, output: EngineCoreOutput) -> None:
        queue = self._queues.get(output.request_id)
        if queue is None:
            return  # aborted here meanwhile
        if output.finished:
            self._finish_locally(output.request_id, output)
        else:
            queue.put_nowait(output)

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        rank = self._holder.pop(request_id, None)
        if rank is not None:
            self._stats[rank].in_flight.discard(request_id)

    def _finish_locally(self, request_id: str, item: _Item) -> None:
        """Hand a request its last item and stop tracking it."""
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(item)
        self._forget(request_id)
