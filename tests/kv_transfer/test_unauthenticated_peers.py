"""Issue 44 #8 and #11, against the real kv_transfer service and block checks
(in process, no model). Before: a service with a 1 MiB frame limit buffered
400 frames of 0.95 MiB (438 MB) of one message; it ran without CURVE by
default; a keyless block carried only a CRC-32 any local user could forge,
and a block whose bytes did not fill its header's shape was loaded."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import zmq

from protocol.codec import Decoder, Encoder
from protocol.kv_transfer import KVBlock, KVPut, KVServiceReply, KVStatsRequest, KVTransferConfig
from protocol.zmq_sockets import make_socket, recv, send
from services.kv_transfer.base import KVConnectorRole
from services.kv_transfer.block_store import checksum, is_intact, seal
from services.kv_transfer.service import MAX_FRAMES_PER_MESSAGE, build_parser, check_exposure
from services.kv_transfer.zmq_connector import ZmqConnector
from tests.engine_core.fakes import make_config
from tests.kv_transfer.test_service import RunningService, block


@pytest.fixture
def service():
    running = RunningService(max_bytes=1 << 24)
    running.service.max_message_bytes = 1 << 20
    yield running
    running.close()


def test_a_message_of_too_many_frames_or_bytes_is_dropped_unread(service):
    ctx = zmq.Context()
    encoder, decoder = Encoder(), Decoder(KVServiceReply)
    try:
        sock = make_socket(ctx, zmq.DEALER, service.address, bind=False)
        # A put whose header is real and whose frames go on: more frames than any put has.
        header, *frames = encoder.encode(KVPut(1, [block(b"many")]))
        sock.send_multipart([header, *frames, *([b"\0" * 1024] * MAX_FRAMES_PER_MESSAGE)], copy=False)
        # One of the right shape, but 2 MiB in all, over the 1 MiB per-message limit.
        send(sock, encoder, KVPut(2, [block(b"big-a", 1 << 20), block(b"big-b", 1 << 20)]))
        send(sock, encoder, KVPut(3, [block(b"small")]))  # an honest put still goes through
        assert sock.poll(10_000)
        _, reply = recv(sock, decoder)
        assert reply.seq == 3 and reply.num_stored == 1
        assert service.service.num_dropped == 2
        assert b"many" not in service.service.store and b"big-a" not in service.service.store
        send(sock, encoder, KVStatsRequest(4))
        assert sock.poll(10_000) and recv(sock, decoder)[1].num_blocks == 1
        sock.close()
    finally:
        ctx.destroy(linger=0)


def test_the_service_needs_curve_unless_told_otherwise_on_loopback():
    parser = build_parser()
    with pytest.raises(ValueError, match="--zmq-curve-keys"):
        check_exposure(parser.parse_args([]))
    with pytest.raises(ValueError, match="loopback"):
        check_exposure(parser.parse_args(["--insecure-no-curve", "--host", "0.0.0.0"]))
    check_exposure(parser.parse_args(["--insecure-no-curve"]))
    check_exposure(parser.parse_args(["--zmq-curve-keys", "/some/keys", "--host", "0.0.0.0"]))


def test_a_worker_without_keys_refuses_blocks_from_an_unauthenticated_service():
    def config(**extra):
        kv = KVTransferConfig("ZmqConnector", "kv_consumer", kv_connector_extra_config=extra)
        return msgspec.structs.replace(make_config(block_size=16), kv_transfer=kv)

    with pytest.raises(ValueError, match="keys_dir"):
        ZmqConnector(config(), KVConnectorRole.WORKER)
    ZmqConnector(config(), KVConnectorRole.SCHEDULER)  # the scheduler side moves no block
    ZmqConnector(config(allow_unauthenticated=True), KVConnectorRole.WORKER)  # opted out: it starts


@pytest.mark.parametrize("mac_key", [None, b"k" * 32])
def test_a_block_whose_bytes_do_not_fill_its_shape_is_refused(mac_key):
    good = seal(block(b"k", 1024), mac_key)
    assert is_intact(good, "float32", [256], mac_key)
    for nbytes in (1020, 1028, 4096):  # short, long, a whole other size: each sealed by its producer
        data = np.zeros(nbytes, np.uint8)
        forged = seal(KVBlock(b"k", "float32", [256], checksum(data), data), mac_key)
        assert not is_intact(forged, "float32", [256], mac_key)
    assert not is_intact(seal(KVBlock(b"k", "nonsense", [256], 0, good.data), mac_key), "nonsense", [256])
