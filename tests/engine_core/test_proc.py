"""One real engine-core process, driven by a hand-made API on real sockets.

The test plays the API's part with the same helpers and messages the real
client uses, so it sees exactly what crosses the wire: the handshake, the
ready frame, outputs and heartbeats, error outputs, and the goodbye. Every
test runs against an engine with and without async scheduling.
"""

from __future__ import annotations

import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    SamplingParams,
)
from protocol.codec import Decoder, Encoder
from protocol.engine import UtilityMethod, UtilityRequest, UtilityResult
from protocol.handshake import EngineGoodbye, EngineHandshakeReply, EngineHello, EngineReady, EngineStatus
from protocol.zmq_sockets import bound_address, ipc_address, make_socket, rank_identity, recv, send
from tests.polling import wait_for
from tests.tiny_model import build_tiny_llama, tiny_engine_config

pytestmark = pytest.mark.slow

RANK = 1
NUM_BLOCKS = 64
DEADLINE_S = 60.0  # engine start-up on two busy cores


class FakeApi:
    """The API's three sockets, bound in the test process."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.handshake = make_socket(self.ctx, zmq.ROUTER, ipc_address("hs"), bind=True)
        self.input = make_socket(self.ctx, zmq.ROUTER, ipc_address("in"), bind=True)
        self.output = make_socket(self.ctx, zmq.ROUTER, ipc_address("out"), bind=True)
        self.encoder = Encoder()
        self.outputs_decoder = Decoder(EngineCoreOutputs)
        self.identity = b""  # the engine's own (``instance_identity``), learnt from its hello

    def recv(self, sock: zmq.Socket, decoder: Decoder, num_header: int = 0, timeout_s: float = 10.0):
        assert sock.poll(int(timeout_s * 1000)), "timed out waiting for a message"
        return recv(sock, decoder, num_header)

    def send(self, kind: EngineCoreRequestType, payload=None) -> None:
        if payload is None:
            self.input.send_multipart([self.identity, kind.value])
        else:
            send(self.input, self.encoder, payload, self.identity, kind.value)

    def next_outputs(self, timeout_s: float = 10.0) -> EngineCoreOutputs:
        (identity,), outputs = self.recv(self.output, self.outputs_decoder, 1, timeout_s=timeout_s)
        assert identity == self.identity  # outputs come from the identity that said hello
        return outputs

    def run_until_finished(self, request_ids: set[str], timeout_s: float = 30.0) -> dict:
        """Collect outputs per request until all of ``request_ids`` finished."""
        tokens: dict[str, list[int]] = {rid: [] for rid in request_ids}
        last = {}

        def all_finished() -> bool:
            batch = self.next_outputs()
            assert batch.engine_index == RANK
            for out in batch.outputs:
                if out.request_id in tokens:
                    tokens[out.request_id] += out.new_token_ids
                    last[out.request_id] = out
            return all(rid in last and last[rid].finished for rid in request_ids)

        wait_for(all_finished, timeout_s, lambda: f"the requests to finish: {tokens}", interval_s=0)
        return {rid: (tokens[rid], last[rid]) for rid in request_ids}

    def wait_for_tokens_of(self, request_id: str, timeout_s: float = 20.0) -> None:
        """Until an output carries tokens of ``request_id`` (it is running)."""
        wait_for(
            lambda: any(o.request_id == request_id and o.new_token_ids for o in self.next_outputs().outputs),
            timeout_s,
            f"tokens of {request_id}",
            interval_s=0,
        )

    def stats_until(self, predicate, timeout_s: float = 20.0, what: str = "the engine's stats to match"):
        """The first scheduler stats that match ``predicate``."""

        def matching():
            stats = self.next_outputs().scheduler_stats
            return stats if stats is not None and predicate(stats) else None

        return wait_for(matching, timeout_s, what, interval_s=0)


def make_request(request_id: str, max_tokens: int = 5, prompt_len: int = 8) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(range(100, 100 + prompt_len)),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        arrival_time=time.time(),
    )


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def started(tmp_path_factory, request):
    """(fake api, engine process, ready message); the process is always killed."""
    config = tiny_engine_config(build_tiny_llama(tmp_path_factory.mktemp("tiny")), NUM_BLOCKS)
    scheduler = msgspec.structs.replace(config.scheduler, async_scheduling=request.param)
    config = msgspec.structs.replace(config, scheduler=scheduler)
    api = FakeApi()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.engine_core.proc",
            "--rank",
            str(RANK),
            "--handshake-address",
            bound_address(api.handshake),
            "--num-threads",
            "1",
        ]
    )
    try:
        (identity,), hello = api.recv(api.handshake, Decoder(EngineHello), 1, DEADLINE_S)
        assert identity[:2] == rank_identity(RANK) and len(identity) == 10  # the rank, then random bytes
        api.identity = identity
        assert hello == EngineHello(rank=RANK, local=False, headless=False)
        parallel = msgspec.structs.replace(config.parallel, data_parallel_rank=RANK)
        reply = EngineHandshakeReply(
            config=msgspec.structs.replace(config, parallel=parallel),
            input_address=bound_address(api.input),
            output_address=bound_address(api.output),
        )
        send(api.handshake, api.encoder, reply, identity)
        (identity,), ready = api.recv(api.input, Decoder(EngineStatus), 1, DEADLINE_S)
        assert identity == api.identity
        yield api, proc, ready
    finally:
        proc.kill()
        proc.wait()
        api.ctx.destroy(linger=0)


def test_ready_frame_reports_the_cache(started):
    _, _, ready = started
    assert ready == EngineReady(rank=RANK, num_blocks=NUM_BLOCKS, max_model_len=512)


def test_requests_complete_with_their_token_counts(started):
    api, _, _ = started
    api.send(EngineCoreRequestType.ADD, make_request("a", max_tokens=5))
    api.send(EngineCoreRequestType.ADD, make_request("b", max_tokens=9, prompt_len=20))
    results = api.run_until_finished({"a", "b"})
    assert len(results["a"][0]) == 5 and results["a"][1].finish_reason == FinishReason.LENGTH
    assert len(results["b"][0]) == 9 and results["b"][1].finish_reason == FinishReason.LENGTH


def test_rejected_request_errors_only_itself(started):
    api, _, _ = started
    api.send(EngineCoreRequestType.ADD, make_request("too-long", prompt_len=600))
    api.send(EngineCoreRequestType.ADD, make_request("fine", max_tokens=3))
    results = api.run_until_finished({"too-long", "fine"})
    tokens, last = results["too-long"]
    assert tokens == [] and last.finish_reason == FinishReason.ERROR
    assert "max_model_len" in last.error
    assert len(results["fine"][0]) == 3


def test_malformed_frames_are_dropped(started):
    api, proc, _ = started
    api.input.send_multipart([api.identity, EngineCoreRequestType.ADD.value, b"\xc1garbage"])
    api.input.send_multipart([api.identity, b"\x09", b"unknown type"])
    api.input.send_multipart([api.identity, EngineCoreRequestType.ABORT.value])  # no payload
    api.input.send_multipart([api.identity, EngineCoreRequestType.ABORT.value, b"\x92\x01\x02"])  # ints
    api.input.send_multipart([api.identity, EngineCoreRequestType.UTILITY.value, b"\x90"])
    api.send(EngineCoreRequestType.ADD, make_request("after-garbage", max_tokens=4))
    assert len(api.run_until_finished({"after-garbage"})["after-garbage"][0]) == 4
    assert proc.poll() is None


def test_idle_engine_sends_heartbeats_with_stats(started):
    api, _, _ = started

    def idle_heartbeat():
        batch = api.next_outputs()
        return None if batch.outputs else batch.scheduler_stats

    stats = wait_for(idle_heartbeat, 10, "a heartbeat from an idle engine", interval_s=0)
    assert stats.num_running_reqs == 0


def test_abort_frees_the_blocks(started):
    api, _, _ = started
    api.send(EngineCoreRequestType.ADD, make_request("long", max_tokens=400, prompt_len=40))
    api.wait_for_tokens_of("long")
    api.send(EngineCoreRequestType.ABORT, ["long"])
    stats = api.stats_until(
        lambda s: s.num_running_reqs == 0 and s.num_waiting_reqs == 0, what="the aborted request to stop"
    )
    assert stats.num_free_blocks == stats.num_total_blocks == NUM_BLOCKS - 1


def call(api: FakeApi, call_id: int, method: UtilityMethod) -> UtilityResult:
    """A utility call, answered by a batch of its own (other batches are skipped)."""
    api.send(EngineCoreRequestType.UTILITY, UtilityRequest(call_id, method))
    result = wait_for(
        lambda: api.next_outputs().utility_output, 10, f"an answer to {method.value}", interval_s=0
    )
    assert result.call_id == call_id
    return result


def test_paused_engine_holds_a_request_until_resumed(started):
    api, _, _ = started
    assert call(api, 1, UtilityMethod.PAUSE) == UtilityResult(1, ok=True)
    api.send(EngineCoreRequestType.ADD, make_request("held", max_tokens=3))
    heartbeats = 0
    while heartbeats < 3:  # about 1.5 s of an engine that could have finished it
        batch = api.next_outputs()
        assert not any(o.request_id == "held" for o in batch.outputs)
        stats = batch.scheduler_stats
        heartbeats += stats is not None and stats.num_waiting_reqs == 1 and not batch.outputs
    assert call(api, 2, UtilityMethod.RESUME).ok
    tokens, last = api.run_until_finished({"held"})["held"]
    assert len(tokens) == 3 and last.finish_reason == FinishReason.LENGTH


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use(started):
    api, _, _ = started
    api.send(EngineCoreRequestType.ADD, make_request("busy", max_tokens=400, prompt_len=40))
    api.wait_for_tokens_of("busy")
    assert call(api, 3, UtilityMethod.RESET_PREFIX_CACHE) == UtilityResult(3, ok=False)
    api.send(EngineCoreRequestType.ABORT, ["busy"])
    # The ABORT is handled before the next call on the same link: every block is free again.
    assert call(api, 4, UtilityMethod.RESET_PREFIX_CACHE) == UtilityResult(4, ok=True)


def test_shutdown_says_goodbye_and_exits(started):
    """Last in this module: it stops the shared engine."""
    api, proc, _ = started
    api.send(EngineCoreRequestType.SHUTDOWN)
    (identity,), status = api.recv(api.input, Decoder(EngineStatus), 1, 10)
    assert identity == api.identity and isinstance(status, EngineGoodbye) and status.rank == RANK
    api.send(EngineCoreRequestType.SHUTDOWN)  # the acknowledgement
    assert proc.wait(timeout=10) == 0
