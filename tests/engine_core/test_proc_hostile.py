"""An engine-core process under hostile input, on CURVE links, and draining on SIGTERM.

The test plays the API's part on real sockets (a tiny random Llama runs in
the engine), so it sees exactly what crosses the wire: fuzzed frames are
counted and dropped while valid requests are still served; with CURVE, only
peers holding the keys get a message through; SIGTERM finishes the requests
held before the goodbye.
"""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType, FinishReason, SamplingParams
from protocol.codec import Decoder, Encoder
from protocol.curve import CLIENT, SERVER, CurveKeys, ZapAuthenticator, generate_keys, load_keys
from protocol.engine import UtilityMethod, UtilityRequest
from protocol.handshake import (
    EngineDraining,
    EngineGoodbye,
    EngineHandshakeReply,
    EngineHello,
    EngineReady,
    EngineStatus,
)
from protocol.zmq_sockets import (
    bound_address,
    ipc_address,
    make_socket,
    rank_identity,
    recv,
    send,
    tcp_address,
)
from services.engine_core.proc import _decode_request
from tests.polling import keep_for, wait_for
from tests.tiny_model import build_tiny_llama, tiny_engine_config
from tests.utils import KeepingContext

pytestmark = pytest.mark.slow

RANK = 1
DEADLINE_S = 60.0  # engine start-up on two busy cores
QUIET_MS = 800  # how long a refused peer gets to push a message through


class Api:
    """The API's three sockets, bound in the test process (CURVE servers if ``curve``)."""

    def __init__(self, curve: CurveKeys | None = None) -> None:
        self.ctx = zmq.Context()
        self.auth = ZapAuthenticator(self.ctx, curve) if curve is not None else None

        def bind(kind: int, name: str) -> zmq.Socket:
            address = tcp_address("127.0.0.1", 0, bind=True) if curve else ipc_address(name)
            return make_socket(self.ctx, kind, address, bind=True, curve=curve)

        self.handshake, self.input, self.output = (
            bind(zmq.ROUTER, "hs"),
            bind(zmq.ROUTER, "in"),
            bind(zmq.ROUTER, "out"),
        )
        self.encoder = Encoder()
        self.identity = b""  # the engine's own (``instance_identity``), learnt from its hello

    def close(self) -> None:
        if self.auth is not None:
            self.auth.stop()
        self.ctx.destroy(linger=0)

    def send(self, kind: EngineCoreRequestType, payload=None) -> None:
        if payload is None:
            self.input.send_multipart([self.identity, kind.value])
        else:
            send(self.input, self.encoder, payload, self.identity, kind.value)

    def status(self, timeout_s: float = 10.0):
        assert self.input.poll(int(timeout_s * 1000)), "no status message from the engine"
        (identity,), status = recv(self.input, Decoder(EngineStatus), 1)
        assert identity == self.identity
        return status

    def outputs(self, timeout_s: float = 10.0) -> EngineCoreOutputs:
        assert self.output.poll(int(timeout_s * 1000)), "no outputs from the engine"
        (identity,), outputs = recv(self.output, Decoder(EngineCoreOutputs), 1)
        assert identity == self.identity
        return outputs

    def run_until_finished(self, request_ids: set[str], timeout_s: float = 60.0) -> dict:
        """Tokens and last output per request, once all of ``request_ids`` finished."""
        tokens: dict[str, list[int]] = {rid: [] for rid in request_ids}
        last: dict = {}

        def all_finished() -> bool:
            for out in self.outputs().outputs:
                if out.request_id in tokens:
                    tokens[out.request_id] += out.new_token_ids
                    last[out.request_id] = out
            return all(rid in last and last[rid].finished for rid in request_ids)

        wait_for(all_finished, timeout_s, lambda: f"the requests to finish: {tokens}", interval_s=0)
        return {rid: (tokens[rid], last[rid]) for rid in request_ids}

    def wait_for_output_of(self, request_id: str, timeout_s: float = DEADLINE_S) -> None:
        """Until the engine sent an output of ``request_id`` (heartbeats alone do not end the wait)."""
        wait_for(
            lambda: any(o.request_id == request_id for o in self.outputs().outputs),
            timeout_s,
            f"an output of {request_id}",
            interval_s=0,
        )

    def wait_for_utility_answer(self, call_id: int, timeout_s: float = 10.0) -> None:
        def answer():
            result = self.outputs().utility_output
            return result if result is not None and result.call_id == call_id else None

        assert wait_for(answer, timeout_s, f"an answer to utility call {call_id}", interval_s=0).ok

    def stats_until(self, predicate, timeout_s: float = 10.0):
        def matching():
            stats = self.outputs().scheduler_stats
            return stats if stats is not None and predicate(stats) else None

        return wait_for(matching, timeout_s, "the engine's stats to match", interval_s=0)


def make_request(request_id: str, max_tokens: int = 4) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(range(100, 108)),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        arrival_time=time.time(),
    )


def start_engine(api: Api, config, *extra: str) -> subprocess.Popen:
    """An engine process that has shaken hands with ``api`` and sent its ready frame."""
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
            *extra,
        ]
    )
    assert api.handshake.poll(int(DEADLINE_S * 1000)), "no hello from the engine"
    (identity,), hello = recv(api.handshake, Decoder(EngineHello), 1)
    assert hello.rank == RANK
    api.identity = identity  # the input socket must use the same one
    parallel = msgspec.structs.replace(config.parallel, data_parallel_rank=RANK)
    send(
        api.handshake,
        api.encoder,
        EngineHandshakeReply(
            config=msgspec.structs.replace(config, parallel=parallel),
            input_address=bound_address(api.input),
            output_address=bound_address(api.output),
        ),
        identity,
    )
    assert isinstance(api.status(DEADLINE_S), EngineReady)
    return proc


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return tiny_engine_config(build_tiny_llama(tmp_path_factory.mktemp("tiny")), 64)


class EngineSlot:
    """One engine process (and its fake API) that tests share, started again
    for the next test when one stopped it: tests need no particular order."""

    def __init__(self, config, *extra: str, curve: CurveKeys | None = None) -> None:
        self.config, self.extra, self.curve = config, extra, curve
        self.api: Api | None = None
        self.proc: subprocess.Popen | None = None
        self.expected: dict[str, int] = {}

    def get(self) -> tuple[Api, subprocess.Popen, dict[str, int]]:
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self.api = Api(self.curve)
            self.proc = start_engine(self.api, self.config, *self.extra)
            self.expected = {"dropped": 0}  # frames this engine should have dropped
        return self.api, self.proc, self.expected

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        if self.api is not None:
            self.api.close()
        self.api = self.proc = None


@pytest.fixture(scope="module")
def plain_slot(config):
    slot = EngineSlot(config, "--shutdown-timeout", "30")
    yield slot
    slot.close()


@pytest.fixture
def plain(plain_slot):
    """(api, engine process, {"dropped": frames the engine should have dropped})."""
    return plain_slot.get()


# ---- fuzzing the input socket

_ids = itertools.count()
_DECODERS = {
    EngineCoreRequestType.ADD: Decoder(EngineCoreRequest),
    EngineCoreRequestType.ABORT: Decoder(list[str]),
    EngineCoreRequestType.UTILITY: Decoder(UtilityRequest),
}
# SHUTDOWN and DRAIN are the API's commands, not malformed input: left out.
_TYPE_BYTES = st.sampled_from(
    [EngineCoreRequestType.ADD.value, EngineCoreRequestType.ABORT.value, EngineCoreRequestType.UTILITY.value]
) | st.binary(max_size=3).filter(
    lambda b: b not in (EngineCoreRequestType.SHUTDOWN.value, EngineCoreRequestType.DRAIN.value)
)
_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


def _encoded_request() -> bytes:
    return Encoder().encode(make_request(f"fuzz-{next(_ids)}", max_tokens=2))[0]


@st.composite
def hostile_messages(draw) -> list[bytes]:
    kind = draw(_TYPE_BYTES)
    body = draw(
        st.one_of(
            st.lists(st.binary(max_size=64), max_size=3),  # random frames
            st.integers(0, 200).map(lambda cut: [_encoded_request()[:cut]]),  # a request cut short
            _msgpack_values.map(lambda v: [msgspec.msgpack.encode(v)]),  # well-formed msgpack, wrong shape
            st.binary(min_size=1, max_size=32).map(
                lambda extra: [_encoded_request(), extra]
            ),  # stray extra frame
            st.integers(0, 40).map(
                lambda i: [_encoded_request()[:i] + b"\xc1" + _encoded_request()[i:]]
            ),  # bad byte
        )
    )
    return [kind, *body]


def _is_dropped(message: list[bytes]) -> bool:
    try:
        _decode_request(message, _DECODERS)
    except ValueError:
        return True
    return False


def test_fuzzed_frames_are_dropped_and_it_still_serves(plain):
    api, proc, expected = plain

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(message=hostile_messages())
    def send_hostile(message):
        api.input.send_multipart([api.identity, *message])
        expected["dropped"] += _is_dropped(message)

    before = expected["dropped"]
    send_hostile()
    assert expected["dropped"] - before > 300  # the fuzz really was hostile
    api.send(EngineCoreRequestType.ADD, make_request("after-fuzz", max_tokens=5))
    tokens, last = api.run_until_finished({"after-fuzz"})["after-fuzz"]
    assert len(tokens) == 5 and last.finish_reason == FinishReason.LENGTH
    api.stats_until(lambda s: s.num_dropped_frames == expected["dropped"])
    assert proc.poll() is None


def test_sigterm_drains_every_request_then_says_goodbye(plain):
    """It stops the shared engine; the next test gets a new one."""
    api, proc, _ = plain
    api.send(EngineCoreRequestType.ADD, make_request("held", max_tokens=60))
    api.wait_for_output_of("held")
    proc.send_signal(signal.SIGTERM)
    draining = api.status()
    assert draining == EngineDraining(rank=RANK, timeout_s=30.0)
    # Sent before the API's DRAIN answer: it must be served too, not dropped.
    api.send(EngineCoreRequestType.ADD, make_request("late", max_tokens=3))
    api.send(EngineCoreRequestType.DRAIN)
    results = api.run_until_finished({"held", "late"})
    assert results["late"][1].finish_reason == FinishReason.LENGTH and len(results["late"][0]) == 3
    assert results["held"][1].finish_reason == FinishReason.LENGTH
    goodbye = api.status()
    assert isinstance(goodbye, EngineGoodbye) and goodbye.reason == "drained"
    api.send(EngineCoreRequestType.SHUTDOWN)  # acknowledges the goodbye
    assert proc.wait(timeout=15) == 0


# ---- CURVE


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys") / "curve"
    generate_keys(folder)
    return folder


@pytest.fixture(scope="module")
def curved_slot(config, keys):
    slot = EngineSlot(
        config, "--zmq-curve-keys", str(keys), "--shutdown-timeout", "0.5", curve=load_keys(keys, SERVER)
    )
    yield slot
    slot.close()


@pytest.fixture
def curved(curved_slot):
    api, proc, _ = curved_slot.get()
    return api, proc


def test_with_the_keys_requests_flow(curved):
    api, _ = curved
    api.send(EngineCoreRequestType.ADD, make_request("keyed", max_tokens=4))
    tokens, last = api.run_until_finished({"keyed"})["keyed"]
    assert len(tokens) == 4 and last.finish_reason == FinishReason.LENGTH


def attacker_send(sock: zmq.Socket, encoder: Encoder, message, *headers: bytes) -> None:
    """Send, or give up after a second: once the API refused the handshake the socket
    has no link, and a DEALER or PUSH without one blocks for ever (nothing got through)."""
    sock.setsockopt(zmq.SNDTIMEO, 1000)
    try:
        send(sock, encoder, message, *headers)
    except zmq.Again:
        pass


def test_without_the_keys_nothing_gets_through(curved, keys, config):
    api, proc = curved
    ctx = KeepingContext()  # the attackers' sockets stay open until destroy() closes them
    try:
        public, secret = zmq.curve_keypair()
        stranger = CurveKeys(CLIENT, public, secret, load_keys(keys, CLIENT).peer_public)
        encoder = Encoder()
        for curve in (None, stranger):  # no CURVE at all; CURVE with keys of its own
            # Pose as rank 1 on every socket the API binds: hello, status, outputs.
            for sock_type, target, message in (
                (zmq.DEALER, api.handshake, EngineHello(rank=RANK, local=False, headless=True)),
                (zmq.DEALER, api.input, EngineGoodbye(rank=RANK, reason="forged")),
                (zmq.DEALER, api.output, EngineCoreOutputs(engine_index=RANK, outputs=[])),
            ):
                sock = make_socket(
                    ctx,
                    sock_type,
                    bound_address(target),
                    bind=False,
                    identity=rank_identity(RANK) if sock_type == zmq.DEALER else None,
                    curve=curve,
                )
                attacker_send(sock, encoder, message)
            injected = make_socket(ctx, zmq.DEALER, bound_address(api.input), bind=False, curve=curve)
            attacker_send(
                injected, encoder, make_request("injected", max_tokens=2), EngineCoreRequestType.ADD.value
            )
        assert not api.handshake.poll(QUIET_MS) and not api.input.poll(QUIET_MS)
        assert api.auth.denied.wait(5)

        # Only the real engine's outputs arrive, and the engine never saw the injected request.
        def only_the_engines_outputs() -> None:
            batch = api.outputs()
            assert all(o.request_id != "injected" for o in batch.outputs)
            assert batch.scheduler_stats is None or batch.scheduler_stats.num_dropped_frames == 0

        keep_for(only_the_engines_outputs, QUIET_MS / 1000)
        # An impostor API (its own keys) never hears an engine that holds the real ones.
        impostor = Api(CurveKeys(SERVER, *zmq.curve_keypair(), load_keys(keys, CLIENT).public))
        fooled = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.engine_core.proc",
                "--rank",
                "0",
                "--handshake-address",
                bound_address(impostor.handshake),
                "--zmq-curve-keys",
                str(keys),
            ]
        )
        try:
            assert not impostor.handshake.poll(3000), "the engine talked to an impostor"
            assert fooled.poll() is None  # still waiting for the real API
        finally:
            fooled.kill()
            fooled.wait()
            impostor.close()
    finally:
        ctx.destroy(linger=0)
    test_with_the_keys_requests_flow(curved)  # the real link still works
    assert proc.poll() is None


def test_drain_timeout_stops_with_requests_unfinished(curved):
    """It stops the shared engine (the next test gets a new one). The API never answers the drain notice here."""
    api, proc = curved
    api.send(EngineCoreRequestType.ADD, make_request("too-long", max_tokens=400))
    api.wait_for_output_of("too-long")
    # Paused, it holds the request through the drain whatever the machine's speed (on a fast one
    # the tiny model would finish its 400 tokens inside the half second).
    api.send(EngineCoreRequestType.UTILITY, UtilityRequest(1, UtilityMethod.PAUSE))
    api.wait_for_utility_answer(1)
    proc.send_signal(signal.SIGTERM)
    assert isinstance(api.status(), EngineDraining)
    goodbye = api.status()
    assert isinstance(goodbye, EngineGoodbye)
    assert goodbye.reason == "drain timed out after 0.5s with 1 request(s) unfinished"
    api.send(EngineCoreRequestType.SHUTDOWN)
    assert proc.wait(timeout=15) == 0
