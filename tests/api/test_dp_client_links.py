"""The API's links to its engine cores under attack, against the real
DPLBEngineClient and an in-process stand-in engine (no model): a peer that
claims a live rank is refused while the real rank keeps serving, a rank
that went quiet rejoins when heard again, and a request for a rank whose
connection is gone fails clearly instead of vanishing.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import zmq
import zmq.asyncio
import zmq.auth

from protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    SchedulerStats,
)
from protocol.codec import Decoder, Encoder
from protocol.curve import (
    CLIENT,
    SERVER,
    CurveKeys,
    generate_keys,
    generate_node_keys,
    load_keys,
)
from protocol.handshake import (
    EngineDraining,
    EngineGoodbye,
    EngineHandshakeReply,
    EngineHello,
    EngineReady,
)
from protocol.zmq_sockets import (
    arecv,
    asend,
    instance_identity,
    ipc_address,
    make_socket,
    rank_identity,
    tcp_address,
)
from services.api.dp_client import DPLBEngineClient
from services.api.engine_client import EngineDeadError
from tests.api.dp_requests import collect, make_request
from tests.engine_core.fakes import make_config
from tests.polling import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]

RANK = 0
WAIT_S = 10.0
HEARTBEAT_S = 0.05


class StandInEngine:
    """Shakes hands like an engine core, answers each request with its
    ``max_tokens`` tokens, and sends heartbeats while ``beating`` is set."""

    def __init__(
        self, ctx: zmq.asyncio.Context, handshake_address: str, curve: CurveKeys | None = None
    ) -> None:
        self.ctx = ctx
        self.handshake_address = handshake_address
        self.curve = curve
        self.identity = instance_identity(RANK)
        self.encoder = Encoder()
        self.beating = asyncio.Event()
        self.beating.set()
        self.aborted: list[str] = []
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        hs = make_socket(
            self.ctx, zmq.DEALER, self.handshake_address, bind=False, identity=self.identity, curve=self.curve
        )
        await asend(hs, self.encoder, EngineHello(rank=RANK, local=False, headless=True))
        _, reply = await asyncio.wait_for(arecv(hs, Decoder(EngineHandshakeReply)), WAIT_S)
        hs.close()
        self.input = make_socket(
            self.ctx, zmq.DEALER, reply.input_address, bind=False, identity=self.identity, curve=self.curve
        )
        self.output = make_socket(
            self.ctx, zmq.DEALER, reply.output_address, bind=False, identity=self.identity, curve=self.curve
        )
        await asend(self.input, self.encoder, EngineReady(rank=RANK, num_blocks=64, max_model_len=512))
        self._tasks = [asyncio.create_task(self._serve()), asyncio.create_task(self._beat())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self) -> None:
        requests, aborts = Decoder(EngineCoreRequest), Decoder(list[str])
        while True:
            frames = await self.input.recv_multipart()
            kind = EngineCoreRequestType(frames[0])
            if kind is EngineCoreRequestType.SHUTDOWN:
                await asend(self.input, self.encoder, EngineGoodbye(rank=RANK, reason="asked to"))
            elif kind is EngineCoreRequestType.ABORT:
                self.aborted += aborts.decode(frames[1:])
            elif kind is EngineCoreRequestType.ADD:
                request = requests.decode(frames[1:])
                if request.sampling_params.max_tokens > 100:
                    continue  # one that never ends on its own
                tokens = [7] * request.sampling_params.max_tokens
                outputs = [
                    EngineCoreOutput(
                        request_id=request.request_id, new_token_ids=tokens, finish_reason=FinishReason.LENGTH
                    )
                ]
                await asend(self.output, self.encoder, EngineCoreOutputs(engine_index=RANK, outputs=outputs))

    async def _beat(self) -> None:
        while True:
            await self.beating.wait()
            await asend(
                self.output,
                self.encoder,
                EngineCoreOutputs(engine_index=RANK, scheduler_stats=SchedulerStats()),
            )
            await asyncio.sleep(HEARTBEAT_S)  # an engine's heartbeat period, not a wait for anything


def node_keys(folder, node: str) -> CurveKeys:
    """The client keys of one engine node (``weft keys --node``)."""
    public, secret = zmq.auth.load_certificate(folder / f"node-{node}.key_secret")
    return CurveKeys(CLIENT, public, secret, load_keys(folder, SERVER).public)


@contextlib.asynccontextmanager
async def stack(silence_timeout_s: float = 3.0, keys=None):
    """A client of one rank and a stand-in engine serving it; with ``keys``,
    over tcp and CURVE, the engine holding node ``a``'s key."""
    ctx = zmq.asyncio.Context()
    address = ipc_address("hs") if keys is None else tcp_address("127.0.0.1", 0, bind=True)
    client = DPLBEngineClient(
        make_config(block_size=16),
        address,
        1,
        silence_timeout_s=silence_timeout_s,
        curve=None if keys is None else load_keys(keys, SERVER),
    )
    engine = None
    try:
        await client.start()
        engine = StandInEngine(ctx, client.handshake_address, None if keys is None else node_keys(keys, "a"))
        await engine.start()
        await wait_until(lambda: client.ready, WAIT_S, "the rank to be ready")
        yield client, engine, ctx
    finally:
        if engine is not None:
            await engine.stop()
        await client.shutdown()
        ctx.destroy(linger=0)


async def test_a_second_connection_claiming_a_live_rank_is_refused_and_the_rank_keeps_serving():
    async with stack() as (client, engine, ctx):
        encoder = Encoder()
        claimants = []  # kept open: a collected socket drops what it has not sent
        # Claims from connections of their own: a fresh identity, the bare rank, and the real
        # rank's own identity (which a ROUTER without handover refuses to hand over).
        for identity in (instance_identity(RANK), rank_identity(RANK), engine.identity):
            hello = make_socket(ctx, zmq.DEALER, client.handshake_address, bind=False, identity=identity)
            await asend(hello, encoder, EngineHello(rank=RANK, local=False, headless=True))
            status = make_socket(ctx, zmq.DEALER, client.input_address, bind=False, identity=identity)
            await asend(status, encoder, EngineDraining(rank=RANK, timeout_s=1.0))
            await asend(status, encoder, EngineGoodbye(rank=RANK, reason="forged"))
            claimants += [hello, status]
        # Six claims where the identity reached the API; the real identity's second connection
        # is refused by ZMQ itself and never heard.
        await wait_until(
            lambda: client.dropped_frames()["rank_claim"] >= 5, WAIT_S, "the claims to be refused"
        )
        assert client.rank_stats()[RANK].state == "ready"
        tokens, last = await collect(client, make_request("after-claims", max_tokens=3))
        assert tokens == [7, 7, 7] and last.finished
        assert client.rank_stats()[RANK].state == "ready"


async def test_a_rank_silent_longer_than_the_timeout_rejoins_when_it_speaks_again():
    async with stack(silence_timeout_s=1.0) as (client, engine, _):
        in_flight = client.generate(make_request("stalled", max_tokens=1000))
        waiting = asyncio.ensure_future(anext(in_flight))
        engine.beating.clear()  # the node goes quiet (a stall, a network blip)
        with pytest.raises(EngineDeadError, match="sent nothing"):
            await asyncio.wait_for(waiting, WAIT_S)
        assert client.rank_stats()[RANK].state == "dead"
        engine.beating.set()  # heard again
        await wait_until(lambda: client.ready, WAIT_S, "the quiet rank to rejoin")
        await wait_until(lambda: engine.aborted == ["stalled"], WAIT_S, "the stale request to be aborted")
        tokens, last = await collect(client, make_request("after-rejoin", max_tokens=2))
        assert tokens == [7, 7] and last.finished


async def test_a_request_for_a_rank_whose_connection_is_gone_fails_clearly():
    async with stack() as (client, engine, _):
        engine.input.close(linger=0)  # the link drops; the rank's heartbeats still arrive for a while
        engine.beating.clear()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(collect(client, make_request("lost", max_tokens=2)), WAIT_S)


async def test_with_node_keys_a_rank_is_bound_to_the_node_that_shook_hands(tmp_path):
    keys = tmp_path / "keys"
    generate_keys(keys)
    for node in ("a", "b"):
        generate_node_keys(keys, node)
    async with stack(keys=keys) as (client, _, ctx):
        # Over tcp the API notes where the rank's connection came from: its KV events are read there.
        assert client._peer_host[RANK] == "127.0.0.1"
        other_node = node_keys(keys, "b")  # a valid key of the deployment, for another node
        encoder = Encoder()
        hello = make_socket(
            ctx,
            zmq.DEALER,
            client.handshake_address,
            bind=False,
            identity=instance_identity(RANK),
            curve=other_node,
        )
        await asend(hello, encoder, EngineHello(rank=RANK, local=False, headless=True))
        # Outputs for rank 0's request, pushed by node b: never delivered.
        in_flight = client.generate(make_request("held", max_tokens=1000))
        waiting = asyncio.ensure_future(anext(in_flight))
        await wait_until(lambda: client.rank_stats()[RANK].in_flight, WAIT_S, "the request to be routed")
        injector = make_socket(
            ctx,
            zmq.DEALER,
            client.output_address,
            bind=False,
            identity=instance_identity(RANK),
            curve=other_node,
        )
        forged = EngineCoreOutput(request_id="held", new_token_ids=[666], finish_reason=FinishReason.STOP)
        await asend(injector, encoder, EngineCoreOutputs(engine_index=RANK, outputs=[forged]))
        await wait_until(
            lambda: client.dropped_frames()["rank_claim"] >= 2, WAIT_S, "node b's claims to be refused"
        )
        assert not waiting.done() and client.rank_stats()[RANK].state == "ready"
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting  # closing the stream aborts the request
        await in_flight.aclose()
        tokens, last = await collect(client, make_request("served", max_tokens=2))
        assert tokens == [7, 7] and last.finished
        hello.close(linger=0)
        injector.close(linger=0)


async def test_without_curve_forged_heartbeats_and_outputs_from_another_connection_are_refused():
    """Issue 44 #10: a peer that reaches the output socket (no CURVE) sends
    heartbeats, stats and outputs tagged with rank 0, from a fresh identity and
    from the bare rank identity. Nothing is taken: a forged output never
    reaches the request, and the real rank, hung, still goes dead."""
    async with stack(silence_timeout_s=1.0) as (client, engine, ctx):
        encoder = Encoder()
        forgers = [
            make_socket(ctx, zmq.DEALER, client.output_address, bind=False, identity=identity)
            for identity in (instance_identity(RANK), rank_identity(RANK))
        ]
        in_flight = client.generate(make_request("held", max_tokens=1000))
        waiting = asyncio.ensure_future(anext(in_flight))
        await wait_until(lambda: client.rank_stats()[RANK].in_flight, WAIT_S, "the request to be routed")
        engine.beating.clear()  # the real rank hangs: nothing more from it
        forged = EngineCoreOutput(request_id="held", new_token_ids=[666], finish_reason=FinishReason.STOP)
        busy = SchedulerStats(num_running_reqs=999)

        async def forge() -> None:
            while True:
                for sock in forgers:
                    await asend(sock, encoder, EngineCoreOutputs(engine_index=RANK, scheduler_stats=busy))
                    await asend(sock, encoder, EngineCoreOutputs(engine_index=RANK, outputs=[forged]))
                await asyncio.sleep(HEARTBEAT_S)  # a forger's heartbeat period

        forging = asyncio.create_task(forge())
        try:
            with pytest.raises(EngineDeadError, match="sent nothing"):
                await asyncio.wait_for(waiting, WAIT_S)  # never the forged token
            assert client.rank_stats()[RANK].state == "dead"
            assert client.rank_stats()[RANK].num_running != 999
            assert client.dropped_frames()["rank_claim"] >= 4
        finally:
            forging.cancel()
            await asyncio.gather(forging, return_exceptions=True)
            await in_flight.aclose()
            for sock in forgers:
                sock.close(linger=0)
