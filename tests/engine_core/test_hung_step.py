"""A step that never ends shows in the engine's heartbeat (issue 44, item 13).

An engine core with two tensor-parallel workers (model-free, spawned processes)
whose driver rank blocks inside a step, as a rank waiting in a collective for a
stuck peer does: the engine's ``_collect`` waits, the busy loop is stuck in ``step()``, and the
output thread's heartbeats say so (``step_elapsed_s`` grows while
``step_counter`` stays), which is what the API's ``--step-timeout`` reads
(``DPLBEngineClient._stuck_step``). Before: heartbeats looked the same as an
idle engine's, and the rank stayed ready for ever. The API side end to end:
``tests/test_reliability.py``.
"""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from protocol import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType, SamplingParams
from protocol.codec import Decoder, Encoder
from protocol.handshake import EngineHandshakeReply
from protocol.zmq_sockets import instance_identity, ipc_address, make_socket, recv, send
from services.api.dp_client import DPLBEngineClient
from services.engine_core.core import EngineCore
from services.engine_core.proc import EngineCoreProc
from services.worker.multiproc_executor import MultiprocExecutor
from tests.polling import wait_for
from tests.worker.executor_fakes import FAKE_WORKER, fake_config

pytestmark = pytest.mark.slow

DEADLINE_S = 60.0
STUCK_S = 1.0  # heartbeats come every 0.5 s: a step this old is well past one


def test_a_tp_rank_stuck_in_a_step_shows_in_the_heartbeat_and_the_api_calls_it_hung():
    config = fake_config(2)
    config = msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, vocab_size=1000))
    engine = EngineCore(config, executor_class=lambda c: MultiprocExecutor(c, worker_class=FAKE_WORKER))
    ctx = zmq.Context()
    router = make_socket(ctx, zmq.ROUTER, ipc_address("in"), bind=True)
    outputs = make_socket(ctx, zmq.ROUTER, ipc_address("out"), bind=True)  # as the API's
    reply = EngineHandshakeReply(
        config=config,
        input_address=router.getsockopt_string(zmq.LAST_ENDPOINT),
        output_address=outputs.getsockopt_string(zmq.LAST_ENDPOINT),
    )
    identity = instance_identity(0)
    stop = threading.Event()
    proc = EngineCoreProc(engine, ctx, reply, stop, identity=identity)
    runner = threading.Thread(target=proc.run)
    runner.start()
    decoder = Decoder(EngineCoreOutputs)
    try:
        assert router.poll(int(DEADLINE_S * 1000)), "no ready frame"
        router.recv_multipart()  # its EngineReady: the router knows the engine from here
        request = EngineCoreRequest(
            request_id="hang-on-0",  # the driver rank blocks for good inside this step
            prompt_token_ids=[1, 2, 3],
            sampling_params=SamplingParams(max_tokens=4),
            arrival_time=time.time(),
        )
        send(router, Encoder(), request, identity, EngineCoreRequestType.ADD.value)
        beats, batches = [], []

        def stuck_long_enough() -> bool:
            if outputs.poll(1000):
                batch = recv(outputs, decoder, 1)[1]  # after the engine's identity
                if batch.scheduler_stats is not None and batch.scheduler_stats.step_elapsed_s > 0:
                    beats.append(batch.scheduler_stats)
                    batches.append(batch)
            return bool(beats) and beats[-1].step_elapsed_s >= STUCK_S

        wait_for(stuck_long_enough, DEADLINE_S, "a heartbeat that shows the stuck step", interval_s=0)
        last = batches[-1]
        # The same step, older at each beat: the counter is the last step that finished.
        assert len({b.step_counter for b in beats}) == 1
        assert [b.step_elapsed_s for b in beats] == sorted(b.step_elapsed_s for b in beats)
        client = DPLBEngineClient(config, "ipc://unused", 1, step_timeout_s=STUCK_S / 2)
        reason = client._stuck_step(last)
        assert reason is not None and "hung" in reason and "--step-timeout" in reason
        assert DPLBEngineClient(config, "ipc://unused", 1)._stuck_step(last) is None  # within 300 s
    finally:
        for worker in engine.executor.processes:  # the stuck step fails, and the engine stops
            worker.kill()
        runner.join(timeout=DEADLINE_S)
        assert not runner.is_alive()
        router.close(linger=0)
        outputs.close(linger=0)
        ctx.term()
