"""One tensor-parallel worker process, started by ``MultiprocExecutor``.

The loop: receive a ``WorkerCall`` broadcast (ZMQ SUB), run it on the
``Worker``, answer with a ``WorkerReply`` (ZMQ PUSH). The driver (rank 0)
answers every step with its output; the other ranks answer a step only when
it fails on them (one message per step on the hot path, not one per rank),
and answer every other call.

A worker never outlives its engine core: the kernel kills it when the
parent goes (``PR_SET_PDEATHSIG``, Linux), and a watcher thread does the
same from the parent's sentinel elsewhere. SIGINT is ignored: a Ctrl-C
reaches the whole process group, and the engine core decides when its
workers stop.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import traceback

import msgspec
import zmq

from protocol import EngineConfig
from protocol.codec import DecodeError, Decoder, Encoder
from protocol.executor import (
    DetermineNumBlocks,
    ExecuteModel,
    InitializeCache,
    StopWorker,
    WorkerCall,
    WorkerReply,
)
from protocol.zmq_sockets import make_socket, recv, send
from services.log_format import configure as configure_logging
from services.worker.executor import import_worker_class

logger = logging.getLogger(__name__)

DRIVER_RANK = 0
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# Replies still queued when the worker exits get this long to leave (ms).
_REPLY_LINGER_MS = 2000


def main(
    *,
    rank: int,
    config_msgpack: bytes,
    distributed_init_method: str | None,
    call_address: str,
    reply_address: str,
    worker_class: str,
    parent_pid: int,
) -> None:
    """Process entry point (the arguments are plain bytes and strings: the config travels as msgpack)."""
    _die_with_parent(parent_pid)
    _set_process_name(f"weft-tp{rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(  # text or json, as the engine core's (WEFT_LOG_FORMAT)
        process=f"tp-worker-{rank}",
        text_format=f"%(asctime)s %(levelname)s [tp worker {rank}] %(name)s: %(message)s",
    )
    config = msgspec.msgpack.decode(config_msgpack, type=EngineConfig)
    ctx = zmq.Context()
    calls = make_socket(ctx, zmq.SUB, call_address, bind=False)
    calls.setsockopt(zmq.SUBSCRIBE, b"")  # the executor waits for this subscription before its first call
    replies = make_socket(ctx, zmq.PUSH, reply_address, bind=False, linger=_REPLY_LINGER_MS)
    encoder = Encoder()
    code = 0
    try:
        worker = _start_worker(worker_class, config, rank, distributed_init_method)
    except Exception as e:
        logger.exception("Tensor-parallel worker %d failed to start", rank)
        send(replies, encoder, _error_reply(rank, e))
        code = 1
    else:
        send(replies, encoder, WorkerReply(rank=rank))  # started
        _serve(worker, rank, calls, replies, encoder)
    finally:
        calls.close()
        replies.close()
        ctx.term()  # returns once the last reply left (linger)
    # Skip the interpreter's teardown of torch and gloo: seconds on a busy
    # machine, for a process whose work is done and whose sockets are closed.
    logging.shutdown()
    os._exit(code)


def _start_worker(worker_class: str, config: EngineConfig, rank: int, init_method: str | None):
    worker = import_worker_class(worker_class)(config, rank=rank, distributed_init_method=init_method)
    worker.init_device()
    return worker


def _serve(worker, rank: int, calls: zmq.Socket, replies: zmq.Socket, encoder: Encoder) -> None:
    decoder: Decoder[WorkerCall] = Decoder(WorkerCall)
    while True:
        try:
            _, call = recv(calls, decoder)
        except (DecodeError, ValueError) as e:
            logger.warning("Tensor-parallel worker %d dropped a malformed call: %s", rank, e)
            continue
        if isinstance(call, StopWorker):
            worker.shutdown()
            return
        try:
            reply = _handle(worker, rank, call)
        except Exception as e:
            logger.exception("Tensor-parallel worker %d failed on %s", rank, type(call).__name__)
            reply = _error_reply(rank, e)
        if reply is not None:
            send(replies, encoder, reply)


def _handle(worker, rank: int, call: WorkerCall) -> WorkerReply | None:
    if isinstance(call, ExecuteModel):
        output = worker.execute_model(call.scheduler_output)
        return WorkerReply(rank=rank, output=output) if rank == DRIVER_RANK else None
    if isinstance(call, DetermineNumBlocks):
        return WorkerReply(rank=rank, num_blocks=worker.determine_num_blocks())
    if isinstance(call, InitializeCache):
        worker.initialize_cache(call.num_blocks)
        return WorkerReply(rank=rank)
    raise TypeError(f"Unknown worker call {type(call).__name__}.")


def _error_reply(rank: int, error: Exception) -> WorkerReply:
    message = str(error) or traceback.format_exception_only(error)[-1].strip()
    return WorkerReply(rank=rank, error=message, error_type=type(error).__name__)


def _set_process_name(name: str) -> None:
    """What ``ps``/``top`` show (and tests find workers by), instead of another "python"."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15])
    except (OSError, AttributeError):
        pass


def _die_with_parent(parent_pid: int) -> None:
    """Exit as soon as the engine core does, however it ends (even SIGKILL)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the watcher thread below still covers it
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(
            target=_exit_when_gone, args=(parent.sentinel,), name="parent-watch", daemon=True
        ).start()


def _exit_when_gone(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)
