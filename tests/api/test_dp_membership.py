"""RankMembership's state machine, driven by hand-made messages in process.

No socket is bound and no engine started: the handlers the socket loops call
(``on_hello``, ``on_status``, ``accept_outputs``, ``check_ranks``) get the
messages directly, and sends to ranks are recorded. The same transitions
against real engines are in test_dp_client.py, test_dp_client_rejoin.py and
test_dp_client_links.py.
"""

from __future__ import annotations

import time

import pytest

from protocol import (
    EngineConfig,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    ModelConfig,
    SamplingParams,
    SchedulerStats,
)
from protocol.handshake import EngineDraining, EngineGoodbye, EngineHello, EngineReady
from protocol.zmq_sockets import instance_identity
from services.api.dp_client import DPLBEngineClient, rank_load
from services.api.dp_membership import RankMembership
from services.api.engine_client import RankStats

CONFIG = EngineConfig(
    model=ModelConfig(
        model="unused.gguf", tokenizer="unused", served_model_name="m", dtype="float32", max_model_len=512
    )
)
SILENCE_S = 3.0


class Listener:
    """The request client's side: what membership handed on."""

    def __init__(self) -> None:
        self.batches: list[EngineCoreOutputs] = []
        self.dead: list[tuple[int, str]] = []

    def on_outputs(self, batch: EngineCoreOutputs) -> None:
        self.batches.append(batch)

    def on_rank_dead(self, rank: int, reason: str) -> None:
        self.dead.append((rank, reason))


class Members(RankMembership):
    """Its sends to ranks are recorded instead of sent."""

    def __init__(self, num_ranks: int = 2, **kwargs: object) -> None:
        self.listened = Listener()
        super().__init__(
            CONFIG, "ipc://unused", num_ranks, self.listened, silence_timeout_s=SILENCE_S, **kwargs
        )
        self.sent: list[tuple[int, EngineCoreRequestType, object]] = []

    async def send(self, rank: int, kind: EngineCoreRequestType, payload: object = None) -> None:
        self.sent.append((rank, kind, payload))

    def state(self, rank: int) -> str:
        return self.stats[rank].state


def heartbeat(
    rank: int, *, running: int = 0, waiting: int = 0, step_elapsed_s: float = 0.0
) -> EngineCoreOutputs:
    stats = SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting, step_elapsed_s=step_elapsed_s)
    return EngineCoreOutputs(engine_index=rank, scheduler_stats=stats)


async def join(members: Members, rank: int, max_model_len: int = 512) -> bytes:
    """Hello and ready from a fresh engine process; returns its identity."""
    identity = instance_identity(rank)
    assert members.on_hello(identity, EngineHello(rank, local=False, headless=True), None, None)
    await members.on_status(identity, EngineReady(rank, num_blocks=65, max_model_len=max_model_len), None)
    return identity


async def test_a_rank_serves_once_its_connection_said_hello_and_ready():
    members = Members()
    identity = instance_identity(0)
    assert members.on_hello(identity, EngineHello(0, local=False, headless=True), None, "10.0.0.7")
    assert members.state(0) == "waiting" and members.peer_host[0] == "10.0.0.7"
    reply = members.reply_for(0)
    assert (reply.config.parallel.data_parallel_rank, reply.config.parallel.data_parallel_size) == (0, 2)
    await members.on_status(identity, EngineReady(0, num_blocks=65, max_model_len=300), None)
    assert members.state(0) == "ready" and members.stats[0].num_free_blocks == 64  # less the null block
    assert not members.ready and members.live_ranks() == [0]
    await join(members, 1, max_model_len=200)
    assert members.ready and members.max_model_len == 200  # the shortest: a request may go to any rank


async def test_a_rank_is_bound_to_the_connection_and_key_that_shook_hands_for_it():
    members = Members()
    identity = await join(members, 0)
    intruder = instance_identity(0)
    assert not members.on_hello(intruder, EngineHello(0, local=False, headless=True), None, None)
    await members.on_status(intruder, EngineGoodbye(0, "taken over"), None)
    await members.on_status(identity, EngineDraining(0, timeout_s=5.0), "another-node")  # right id, wrong key
    assert not await members.accept_outputs(intruder, heartbeat(0), None)
    assert members.state(0) == "ready" and members.dropped_frames()["rank_claim"] == 4
    assert members.sent == [] and members.listened.batches == []
    # A hello or status whose rank is not its connection's, or out of range, is ignored.
    assert not members.on_hello(instance_identity(1), EngineHello(0, local=False, headless=True), None, None)
    assert not members.on_hello(instance_identity(7), EngineHello(7, local=False, headless=True), None, None)
    await members.on_status(identity, EngineGoodbye(1, "not mine"), None)
    assert members.state(1) == "waiting" and members.dropped_frames()["rank_claim"] == 4


async def test_a_draining_rank_finishes_its_requests_then_its_goodbye_is_acknowledged():
    members = Members()
    identity = await join(members, 0)
    await members.on_status(identity, EngineDraining(0, timeout_s=5.0), None)
    assert members.state(0) == "draining" and members.live_ranks() == [0]
    assert members.sent == [(0, EngineCoreRequestType.DRAIN, None)]
    await members.on_status(identity, EngineGoodbye(0, "drained"), None)
    assert members.state(0) == "dead" and members.listened.dead == [(0, "it stopped (drained)")]
    assert members.sent[-1] == (0, EngineCoreRequestType.SHUTDOWN, None)
    members.mark_dead(0, "again")  # dead once: what it held fails once
    assert len(members.listened.dead) == 1


async def test_a_goodbye_before_ready_gives_the_engines_own_reason():
    members = Members()
    identity = instance_identity(1)
    assert members.on_hello(identity, EngineHello(1, local=False, headless=True), None, None)
    await members.on_status(identity, EngineGoodbye(1, "not enough memory for the KV cache"), None)
    assert members.listened.dead == [(1, "not enough memory for the KV cache")]
    assert members.start_failure is None  # only a rank this API started stops it


async def test_outputs_are_routed_only_from_a_live_rank_after_its_load_is_taken():
    members = Members()
    identity = instance_identity(0)
    assert members.on_hello(identity, EngineHello(0, local=False, headless=True), None, None)
    assert not await members.accept_outputs(identity, heartbeat(0, running=1), None)  # not ready yet
    await members.on_status(identity, EngineReady(0, num_blocks=65, max_model_len=512), None)
    batch = heartbeat(0, running=3, waiting=2)
    assert await members.accept_outputs(identity, batch, None)
    assert (members.stats[0].num_running, members.stats[0].num_waiting) == (3, 2)
    assert not await members.accept_outputs(identity, heartbeat(9), None)  # no such rank


async def test_a_silent_rank_dies_and_rejoins_when_heard_again_aborting_what_it_held():
    members = Members()
    identity = await join(members, 0)
    members.stats[0].in_flight.update({"b", "a"})
    members.check_ranks(time.monotonic() + SILENCE_S / 2)
    assert members.state(0) == "ready"
    members.check_ranks(time.monotonic() + 2 * SILENCE_S)
    assert members.state(0) == "dead" and members.stats[0].num_waiting == 0
    assert members.listened.dead == [(0, f"it sent nothing for {SILENCE_S:.1f}s")]
    assert await members.accept_outputs(identity, heartbeat(0), None)
    assert members.state(0) == "ready"
    assert members.sent == [(0, EngineCoreRequestType.ABORT, ["a", "b"])]


async def test_a_hung_rank_dies_and_rejoins_once_its_heartbeat_left_the_stuck_step():
    members = Members(step_timeout_s=10.0)
    identity = await join(members, 0)
    assert not await members.accept_outputs(identity, heartbeat(0, step_elapsed_s=11.0), None)
    assert members.state(0) == "dead" and "hung" in members.listened.dead[0][1]
    assert not await members.accept_outputs(identity, heartbeat(0, step_elapsed_s=12.0), None)
    assert members.state(0) == "dead"
    assert await members.accept_outputs(identity, heartbeat(0, step_elapsed_s=0.5), None)
    assert members.state(0) == "ready"


async def test_a_dead_rank_rejoins_through_a_new_process_hello_and_ready():
    members = Members()
    old = await join(members, 0)
    await members.on_status(old, EngineGoodbye(0, "restarting"), None)
    new = instance_identity(0)
    assert members.on_hello(new, EngineHello(0, local=False, headless=True), None, None)
    assert members.state(0) == "waiting"
    await members.on_status(old, EngineReady(0, num_blocks=65, max_model_len=512), None)  # the old one's
    assert members.state(0) == "waiting" and members.dropped_frames()["rank_claim"] == 1
    await members.on_status(new, EngineReady(0, num_blocks=65, max_model_len=512), None)
    assert members.state(0) == "ready"


def test_the_membership_checks_its_arguments():
    with pytest.raises(ValueError, match="num_ranks"):
        Members(num_ranks=0)
    with pytest.raises(ValueError, match="step_timeout_s"):
        Members(step_timeout_s=0.0)


def test_the_balancer_picks_the_least_loaded_ready_rank_a_waiting_request_weighing_four():
    assert rank_load(RankStats(rank=0, num_running=3, num_waiting=2)) == 11
    client = DPLBEngineClient(CONFIG, "ipc://unused", 3)
    stats = client.rank_stats()
    for rank, (state, running, waiting) in enumerate([("ready", 4, 1), ("ready", 7, 0), ("draining", 0, 0)]):
        stats[rank].state, stats[rank].num_running, stats[rank].num_waiting = state, running, waiting
    request = EngineCoreRequest(
        request_id="r", prompt_token_ids=[1, 2], sampling_params=SamplingParams(), arrival_time=0.0
    )
    assert client._choose_rank(request) == 1  # 7 < 4 * 1 + 4; the draining rank gets nothing new
    stats[1].num_running = 8
    assert client._choose_rank(request) == 0  # a tie goes to the lower rank
