"""Socket-level limits of the factory: oversize frames, tcp liveness, and
the ipc folders that killed processes leave behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from protocol.zmq_sockets import (
    DEFAULT_MAX_MSG_SIZE,
    HEARTBEAT_IVL_MS,
    identity_rank,
    instance_identity,
    ipc_address,
    make_socket,
    rank_identity,
    remove_stale_ipc_dirs,
    tcp_address,
)

NOBODY = 65534


class _Context(zmq.Context):
    """A context that closes every socket it made when the test ends (no ResourceWarning)."""

    made: list[zmq.Socket] | None = None  # pyzmq wants a subclass's attributes declared here

    def __init__(self) -> None:
        super().__init__()
        self.made = []

    def socket(self, *args, **kwargs) -> zmq.Socket:
        sock = super().socket(*args, **kwargs)
        self.made.append(sock)
        return sock


@pytest.fixture
def ctx():
    context = _Context()
    yield context
    for sock in context.made:
        sock.close(linger=0)
    context.term()


def test_a_peer_sending_an_oversize_frame_is_cut_off_and_others_go_on(ctx):
    address = ipc_address("max")
    pull = make_socket(ctx, zmq.PULL, address, bind=True, max_msg_size=1024)
    default = make_socket(ctx, zmq.PULL, ipc_address("default"), bind=True)
    assert default.getsockopt(zmq.MAXMSGSIZE) == DEFAULT_MAX_MSG_SIZE
    hostile = make_socket(ctx, zmq.PUSH, address, bind=False)
    hostile.send(b"x" * 4096)
    honest = make_socket(ctx, zmq.PUSH, address, bind=False)
    honest.send(b"small")
    assert pull.poll(5000)
    assert pull.recv() == b"small"  # the oversize frame never arrives
    assert not pull.poll(200)


def test_tcp_sockets_send_heartbeats_and_keepalives(ctx):
    tcp = make_socket(ctx, zmq.DEALER, tcp_address("127.0.0.1", 0, bind=True), bind=True)
    assert tcp.getsockopt(zmq.HEARTBEAT_IVL) == HEARTBEAT_IVL_MS and tcp.getsockopt(zmq.TCP_KEEPALIVE) == 1
    local = make_socket(ctx, zmq.DEALER, ipc_address("hb"), bind=True)
    assert local.getsockopt(zmq.HEARTBEAT_IVL) == 0


def test_router_mandatory_refuses_a_send_to_a_peer_that_is_not_there(ctx):
    router = make_socket(ctx, zmq.ROUTER, ipc_address("mand"), bind=True, router_mandatory=True)
    with pytest.raises(zmq.ZMQError) as raised:
        router.send_multipart([b"nobody", b"hi"])
    assert raised.value.errno == zmq.EHOSTUNREACH


def test_instance_identities_carry_the_rank_and_differ_per_process():
    first, second = instance_identity(5), instance_identity(5)
    assert first != second and identity_rank(first) == 5 and first[:2] == rank_identity(5)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_ipc_folders_of_dead_processes_are_removed_and_nothing_else(tmp_path):
    def folder(name: str, owner_tag: str | None, uid: int | None = None) -> Path:
        path = tmp_path / name
        path.mkdir(mode=0o700)
        (path / "engine-sock").write_text("")
        if owner_tag is not None:
            (path / "owner").write_text(owner_tag)
        if uid is not None:
            os.chown(path, uid, uid)
        return path

    ipc_address("own")  # this process's folder has its owner file
    from protocol import zmq_sockets

    live_tag = (Path(zmq_sockets._ipc_dir) / "owner").read_text()
    stale = folder("weft-ipc-stale", f"{_dead_pid()} 123")
    reused = folder("weft-ipc-reused", f"{os.getpid()} 1")  # a live pid, but another process's start time
    live = folder("weft-ipc-live", live_tag)
    legacy = folder("weft-ipc-legacy", None)  # no owner file: not ours to judge
    foreign = folder("weft-ipc-foreign", f"{_dead_pid()} 1", uid=NOBODY)
    other = folder("something-else", f"{_dead_pid()} 1")
    removed = remove_stale_ipc_dirs(str(tmp_path))
    assert sorted(removed) == sorted([str(stale), str(reused)])
    assert not stale.exists() and not reused.exists()
    assert live.exists() and legacy.exists() and foreign.exists() and other.exists()
