"""The ZMQ helpers and handshake messages, in one process over ipc:// and tcp://."""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from protocol import EngineCoreOutputs, EngineCoreRequest, SamplingParams
from protocol.codec import DecodeError, Decoder, Encoder
from protocol.config import EngineConfig, ModelConfig
from protocol.handshake import EngineGoodbye, EngineHandshakeReply, EngineHello, EngineReady, EngineStatus
from protocol.zmq_sockets import (
    arecv,
    asend,
    bound_address,
    identity_rank,
    ipc_address,
    make_socket,
    rank_identity,
    recv,
    send,
    tcp_address,
    tcp_host,
)
from tests.utils import KeepingContext


@pytest.fixture
def ctx():
    context = KeepingContext()  # its sockets are closed at teardown, never left to the collector
    yield context
    context.destroy(linger=0)


def wait_readable(sock: zmq.Socket) -> None:
    assert sock.poll(5000), "timed out waiting for a message"


def test_data_sockets_have_no_high_water_mark(ctx):
    address = ipc_address("hwm")
    router = make_socket(ctx, zmq.ROUTER, address, bind=True, linger=250)
    push = make_socket(ctx, zmq.PUSH, ipc_address("push"), bind=True)
    assert router.getsockopt(zmq.RCVHWM) == 0 and router.getsockopt(zmq.SNDHWM) == 0
    assert router.getsockopt(zmq.LINGER) == 250
    assert push.getsockopt(zmq.SNDHWM) == 0 and push.getsockopt(zmq.LINGER) == 0


def test_ipc_addresses_are_fresh_and_in_a_private_folder():
    first, second = ipc_address("x"), ipc_address("x")
    assert first != second and first.startswith("ipc://")
    assert os.path.dirname(first) == os.path.dirname(second)
    assert os.path.isdir(os.path.dirname(first[len("ipc://") :]))
    assert len(first) < 100  # unix socket paths are short


def test_tcp_addresses():
    assert tcp_address("127.0.0.1", 5555) == "tcp://127.0.0.1:5555"
    assert tcp_address("::1", 5555) == "tcp://[::1]:5555"
    assert tcp_host("tcp://10.0.0.2:29550") == "10.0.0.2"
    with pytest.raises(ValueError, match="port"):
        tcp_address("127.0.0.1", 70000)
    with pytest.raises(ValueError, match="port"):
        tcp_address("127.0.0.1", 0)  # only a binding socket may ask for any port
    with pytest.raises(ValueError, match="tcp"):
        tcp_host("ipc:///tmp/x")


def test_port_zero_binds_a_free_port(ctx):
    sock = make_socket(ctx, zmq.PULL, tcp_address("127.0.0.1", 0, bind=True), bind=True)
    address = bound_address(sock)
    assert address.startswith("tcp://127.0.0.1:") and int(address.rsplit(":", 1)[1]) > 0


def test_rank_identity_is_two_bytes_little_endian():
    assert rank_identity(1) == b"\x01\x00" and rank_identity(258) == b"\x02\x01"
    assert identity_rank(rank_identity(513)) == 513


def test_router_dealer_round_trip_with_headers(ctx):
    address = ipc_address("rd")
    router = make_socket(ctx, zmq.ROUTER, address, bind=True)
    dealer = make_socket(ctx, zmq.DEALER, address, bind=False, identity=rank_identity(3))
    encoder = Encoder()
    send(dealer, encoder, EngineReady(rank=3, num_blocks=10, max_model_len=64))
    wait_readable(router)
    (identity,), status = recv(router, Decoder(EngineStatus), num_header=1)
    assert identity == rank_identity(3) and status == EngineReady(3, 10, 64)
    request = EngineCoreRequest(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_tokens=3),
        arrival_time=1.0,
    )
    send(router, encoder, request, identity, b"\x00")
    wait_readable(dealer)
    (kind,), received = recv(dealer, Decoder(EngineCoreRequest), num_header=1)
    assert kind == b"\x00" and received == request


def test_malformed_message_raises_decode_error(ctx):
    address = ipc_address("bad")
    pull = make_socket(ctx, zmq.PULL, address, bind=True)
    push = make_socket(ctx, zmq.PUSH, address, bind=False)
    push.send_multipart([b"\xc1 not msgpack"])
    wait_readable(pull)
    with pytest.raises(DecodeError):
        recv(pull, Decoder(EngineCoreOutputs))
    push.send_multipart([b"only a header"])
    wait_readable(pull)
    with pytest.raises(ValueError, match="frames"):
        recv(pull, Decoder(EngineCoreOutputs), num_header=1)


async def test_async_send_and_receive():
    ctx = zmq.asyncio.Context()
    try:
        address = ipc_address("async")
        pull = make_socket(ctx, zmq.PULL, address, bind=True)
        push = make_socket(ctx, zmq.PUSH, address, bind=False)
        outputs = EngineCoreOutputs(engine_index=2, timestamp=time.monotonic())
        await asend(push, Encoder(), outputs)
        header, received = await arecv(pull, Decoder(EngineCoreOutputs))
        assert header == [] and received == outputs
    finally:
        ctx.destroy(linger=0)


def test_handshake_messages_round_trip():
    config = EngineConfig(
        model=ModelConfig(model="m", tokenizer="t", served_model_name="n", dtype="float32", max_model_len=128)
    )
    encoder = Encoder()
    for message, decoder in [
        (EngineHello(rank=1, local=True, headless=False), Decoder(EngineHello)),
        (
            EngineHandshakeReply(config=config, input_address="ipc://a", output_address="ipc://b"),
            Decoder(EngineHandshakeReply),
        ),
        (EngineGoodbye(rank=4, reason="SIGTERM"), Decoder(EngineStatus)),
        (EngineReady(rank=0, num_blocks=9, max_model_len=128), Decoder(EngineStatus)),
    ]:
        assert decoder.decode(encoder.encode(message)) == message


def test_handshake_field_order_is_the_wire_contract():
    # array_like: a hello is [rank, local, headless]; statuses carry their tag first.
    assert msgspec.msgpack.decode(Encoder().encode(EngineHello(7, False, True))[0]) == [7, False, True]
    assert msgspec.msgpack.decode(Encoder().encode(EngineReady(1, 2, 3))[0]) == ["ready", 1, 2, 3]
