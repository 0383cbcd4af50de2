"""DPLBEngineClient against real engine-core processes (a tiny random Llama).

Two local ranks over ipc for routing, errors, aborts and a killed rank; one
headless `engine-core` over tcp. Every process is killed in a fixture.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import pytest_asyncio

from protocol import EngineCoreRequest, EngineCoreRequestType, FinishReason, SamplingParams
from protocol.engine import UtilityMethod
from protocol.zmq_sockets import ipc_address, tcp_address
from services import model_files
from services.api import serving
from services.api.dp_client import DPLBEngineClient, launch_local_engines, stop_processes
from services.api.engine_client import EngineDeadError, EngineNotReadyError
from services.api.metrics import APIMetrics
from services.api.output_processor import RequestState
from services.api.serving import Choice, ChoiceRunner
from services.api.tokenizer import Tokenizer
from tests.api.dp_requests import collect, make_request
from tests.polling import wait_until
from tests.tiny_model import build_tiny_llama, tiny_engine_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

NUM_BLOCKS = 64
START_S = 60.0  # engine start-up on two busy cores


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    return tiny_engine_config(build_tiny_llama(tmp_path_factory.mktemp("tiny")), NUM_BLOCKS)


@pytest.fixture(scope="module")
def local_engines():
    """(handshake address, the two local engine processes); always killed."""
    address = ipc_address("hs")
    processes = launch_local_engines(2, 0, address, num_threads=1)
    try:
        yield address, processes
    finally:
        for proc in processes:
            proc.kill()
            proc.wait()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tiny_config, local_engines):
    address, processes = local_engines
    client = DPLBEngineClient(tiny_config, address, 2, processes)
    try:
        await client.start()
        await wait_until(lambda: client.ready, START_S, "both ranks to be ready")
        yield client
    finally:
        await client.shutdown()


async def test_requests_spread_over_both_ranks(client):
    requests = [make_request(f"spread-{i}", max_tokens=30 + i) for i in range(4)]
    before = {rank: s.num_routed for rank, s in client.rank_stats().items()}
    generators = [client.generate(r) for r in requests]
    # Sent in one burst: the local count of sent requests spreads them before
    # any stats come back. (Counted as routed, not as in flight at one moment:
    # one rank may finish its two before the other's first output arrives.)
    firsts = await asyncio.gather(*(anext(g) for g in generators))
    routed = {rank: s.num_routed - before[rank] for rank, s in client.rank_stats().items()}
    assert routed == {0: 2, 1: 2}
    for i, (first, gen) in enumerate(zip(firsts, generators)):
        tokens, last = list(first.new_token_ids), first
        async for output in gen:
            tokens += output.new_token_ids
            last = output
        assert len(tokens) == 30 + i and last.finish_reason == FinishReason.LENGTH
    assert all(not s.in_flight for s in client.rank_stats().values())


async def test_invalid_request_errors_only_itself(client):
    bad, good = await asyncio.gather(
        collect(client, make_request("too-long", prompt_len=600)),
        collect(client, make_request("fine", max_tokens=5)),
    )
    assert bad[0] == [] and bad[1].finish_reason == FinishReason.ERROR and "max_model_len" in bad[1].error
    assert len(good[0]) == 5 and good[1].finish_reason == FinishReason.LENGTH


async def test_duplicate_request_id_is_refused(client):
    # Long enough that it is still in flight when the second arrives: with 50 tokens the tiny model
    # finished between the first output and the next line when two busy cores starved this task.
    gen = client.generate(make_request("dup", max_tokens=400))
    await anext(gen)
    with pytest.raises(ValueError, match="already in flight"):
        await anext(client.generate(make_request("dup")))
    await gen.aclose()


async def test_closing_the_stream_aborts_and_frees_blocks(client):
    gen = client.generate(make_request("closed-early", max_tokens=400, prompt_len=40))
    await anext(gen)
    await anext(gen)
    await gen.aclose()

    def all_idle() -> bool:
        return all(
            s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == NUM_BLOCKS - 1
            for s in client.rank_stats().values()
        )

    await wait_until(all_idle, 10, "the aborted request's blocks to come back")


async def test_abort_by_id_ends_the_stream(client):
    gen = client.generate(make_request("aborted", max_tokens=400))
    await anext(gen)
    await client.abort(["aborted", "unknown-id"])
    outputs = [o async for o in gen]
    assert outputs[-1].finish_reason == FinishReason.ABORT


async def test_health_and_prefix_stats(client):
    assert client.ready
    stats = client.rank_stats()
    assert all(s.state == "ready" and s.num_blocks == NUM_BLOCKS for s in stats.values())
    assert sum(s.totals.prefix_cache_queries for s in stats.values()) > 0


async def test_utility_calls_answer_per_rank(client):
    assert await client.call_utility(UtilityMethod.RESET_PREFIX_CACHE) == {0: True, 1: True}
    request = make_request("holds-blocks", max_tokens=400, prompt_len=40)
    gen = client.generate(request)
    await anext(gen)
    [busy] = [rank for rank, s in client.rank_stats().items() if request.request_id in s.in_flight]
    # The rank holding blocks refuses, the idle one resets.
    assert await client.call_utility(UtilityMethod.RESET_PREFIX_CACHE) == {busy: False, 1 - busy: True}
    await gen.aclose()
    assert await client.call_utility(UtilityMethod.RESET_PREFIX_CACHE) == {0: True, 1: True}


async def drain(gen) -> tuple[object, float]:
    """How a stream ended ("finished" or the error) and when."""
    try:
        async for _ in gen:
            pass
        return "finished", time.monotonic()
    except EngineDeadError as e:
        return e, time.monotonic()


async def test_killed_rank_fails_its_requests_and_the_survivor_serves(client, local_engines):
    """Last in this module: it kills rank 0 of the shared pair."""
    generators = [client.generate(make_request(f"victim-{i}", max_tokens=200)) for i in range(2)]
    for gen in generators:
        await anext(gen)
    assert {r: len(s.in_flight) for r, s in client.rank_stats().items()} == {0: 1, 1: 1}
    local_engines[1][0].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    results = await asyncio.gather(*(drain(g) for g in generators))
    ends = sorted(results, key=lambda r: r[0] == "finished")
    assert isinstance(ends[0][0], EngineDeadError) and ends[1][0] == "finished", results
    assert ends[0][1] - killed_at < 5
    assert client.rank_stats()[0].state == "dead" and not client.ready
    tokens, _ = await collect(client, make_request("survivor", max_tokens=3))
    assert len(tokens) == 3 and client.rank_stats()[1].state == "ready"
    with pytest.raises(EngineNotReadyError):
        await anext(
            client.generate(
                EngineCoreRequest(
                    request_id="pinned",
                    prompt_token_ids=[1, 2],
                    sampling_params=SamplingParams(),
                    arrival_time=time.time(),
                    data_parallel_rank=0,
                )
            )
        )


@pytest.fixture
def headless_processes():
    processes: list[subprocess.Popen] = []
    try:
        yield processes
    finally:
        stop_processes(processes, grace_s=10)


async def test_headless_engine_core_over_tcp(tiny_config, headless_processes):
    client = DPLBEngineClient(tiny_config, tcp_address("127.0.0.1", 0, bind=True), 1)
    try:
        await client.start()
        port = int(client.handshake_address.rsplit(":", 1)[1])
        headless_processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "services.engine_core.cli",
                    "--headless",
                    "--dp-start-rank",
                    "0",
                    "--data-parallel-size",
                    "1",
                    "--data-parallel-size-local",
                    "1",
                    "--data-parallel-address",
                    "127.0.0.1",
                    "--data-parallel-rpc-port",
                    str(port),
                    "--num-threads",
                    "1",
                ]
            )
        )
        await wait_until(lambda: client.ready, START_S, "the headless rank to be ready")
        tokens, last = await collect(client, make_request("remote", max_tokens=6))
        assert len(tokens) == 6 and last.finish_reason == FinishReason.LENGTH
        # Stopping the node: its engine says goodbye, and the client marks the rank dead.
        headless_processes[0].send_signal(signal.SIGTERM)
        await wait_until(lambda: client.rank_stats()[0].state == "dead", 10, "the goodbye")
        assert headless_processes[0].wait(timeout=15) == 0
    finally:
        await client.shutdown()


async def test_the_client_does_not_import_torch():
    code = "import sys, services.api.dp_client; sys.exit('torch' in sys.modules)"
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code)
    assert await proc.wait() == 0


async def test_local_processes_must_fit_the_ranks(tiny_config):
    fake = [subprocess.Popen([sys.executable, "-c", "pass"])]
    try:
        with pytest.raises(ValueError, match="do not fit"):
            DPLBEngineClient(tiny_config, ipc_address("hs"), 2, fake * 2, local_start_rank=1)
        with pytest.raises(ValueError, match="num_ranks"):
            DPLBEngineClient(tiny_config, ipc_address("hs"), 0)
    finally:
        fake[0].wait()


async def test_a_stop_string_hit_sends_exactly_one_abort(client, monkeypatch):
    """The generator's cleanup owns ABORT: the runner closing the stream at a stop
    string must not add an abort of its own (issue 17)."""
    tokenizer = Tokenizer(model_files.resolve(None).hf_dir)
    tokens, _ = await collect(client, make_request("learn", max_tokens=20))  # greedy: the same text again
    stop = tokenizer.decode(tokens[:6]).strip()[-3:]
    assert stop, tokenizer.decode(tokens[:6])
    sent = []
    real_send = client._send

    async def counting_send(rank, kind, payload=None):
        sent.append((kind, payload))
        await real_send(rank, kind, payload)

    monkeypatch.setattr(client, "_send", counting_send)
    learned = make_request("stopped", max_tokens=20)
    params = msgspec.structs.replace(learned.sampling_params, stop=[stop])
    request = msgspec.structs.replace(learned, sampling_params=params)
    state = RequestState.create(request.request_id, params, tokenizer)
    metrics = APIMetrics(client.rank_stats, "tiny").request(len(request.prompt_token_ids), time.monotonic())
    await serving.collect(ChoiceRunner(client, [Choice(0, 0, request, state, metrics)]))
    assert (state.finish_reason, state.stop_reason) == ("stop", stop) and len(state.token_ids) < 20
    aborts = [ids for kind, ids in sent if kind == EngineCoreRequestType.ABORT]
    assert aborts == [["stopped"]]
