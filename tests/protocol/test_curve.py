"""CurveZMQ keys and authentication, in one process over tcp:// on loopback.

The API's side is a CURVE server with a ``ZapAuthenticator``; an engine's is
a client with the keys from ``weft keys``. Peers without those keys try to
get a message through, in each way they could; none arrives.
"""

from __future__ import annotations

import contextlib
import os
import stat

import pytest
import zmq
import zmq.auth

from protocol.curve import (
    CLIENT,
    SERVER,
    CurveKeys,
    ZapAuthenticator,
    generate_keys,
    generate_node_keys,
    load_keys,
)
from protocol.zmq_sockets import bound_address, ipc_address, make_socket, tcp_address
from services.cli import main as weft_main
from tests.utils import KeepingContext

NOTHING_ARRIVES_MS = 600  # how long a refused peer is given to get a message through


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys") / "curve"
    generate_keys(folder)
    return folder


@pytest.fixture
def ctx():
    context = KeepingContext()  # its sockets are closed at teardown, never left to the collector
    yield context
    context.destroy(linger=0)


@pytest.fixture
def server(ctx, keys_dir):
    """(a CURVE ROUTER bound on loopback, its authenticator)."""
    auth = ZapAuthenticator(ctx, load_keys(keys_dir, SERVER))
    sock = make_socket(
        ctx, zmq.ROUTER, tcp_address("127.0.0.1", 0, bind=True), bind=True, curve=load_keys(keys_dir, SERVER)
    )
    yield sock, auth
    auth.stop()


def dealer(ctx, address: str, curve: CurveKeys | None) -> zmq.Socket:
    return make_socket(ctx, zmq.DEALER, address, bind=False, identity=b"\x00\x00", curve=curve)


def test_weft_keys_writes_private_files_and_refuses_to_overwrite(tmp_path, capsys):
    folder = tmp_path / "k"
    assert weft_main(["keys", "--dir", str(folder)]) == 0
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in folder.iterdir())
    first = (folder / "server.key_secret").read_bytes()
    assert weft_main(["keys", "--dir", str(folder)]) == 2
    assert "exists" in capsys.readouterr().err
    assert (folder / "server.key_secret").read_bytes() == first
    assert weft_main(["keys", "--dir", str(folder), "--force"]) == 0
    assert (folder / "server.key_secret").read_bytes() != first


def test_each_role_loads_what_it_needs(keys_dir):
    server, client = load_keys(keys_dir, SERVER), load_keys(keys_dir, CLIENT)
    assert server.peer_public == client.public and client.peer_public == server.public
    assert server.secret != client.secret
    assert client.secret.decode() not in repr(client)  # never logged


def test_loading_refuses_secrets_others_can_read(tmp_path):
    generate_keys(tmp_path / "k")
    os.chmod(tmp_path / "k" / "client.key_secret", 0o644)
    with pytest.raises(ValueError, match="readable by others"):
        load_keys(tmp_path / "k", CLIENT)
    with pytest.raises(ValueError, match="Missing CURVE key"):
        load_keys(tmp_path, SERVER)
    with pytest.raises(ValueError, match="not a folder"):
        load_keys(tmp_path / "nowhere", SERVER)


def test_client_with_the_keys_gets_through(ctx, server, keys_dir):
    sock, auth = server
    client = dealer(ctx, bound_address(sock), load_keys(keys_dir, CLIENT))
    client.send(b"hello")
    assert sock.poll(5000)
    assert sock.recv_multipart() == [b"\x00\x00", b"hello"]
    sock.send_multipart([b"\x00\x00", b"reply"])  # and back
    assert client.poll(5000) and client.recv() == b"reply"
    assert auth.num_denied == 0


def test_peers_without_the_keys_get_nothing_through(ctx, server, keys_dir):
    sock, auth = server
    address = bound_address(sock)
    plain = dealer(ctx, address, None)  # no CURVE at all
    server_public = load_keys(keys_dir, CLIENT).peer_public
    public, secret = zmq.curve_keypair()  # knows the server's public key, but not the client keys
    stranger = dealer(ctx, address, CurveKeys(CLIENT, public, secret, server_public))
    for attacker in (plain, stranger):
        # Without NOBLOCK this send hung when the refused handshake had already dropped the
        # attacker's only pipe: a DEALER with no pipe waits for one. Either way nothing gets through.
        with contextlib.suppress(zmq.Again):
            attacker.send(b"inject", zmq.NOBLOCK)
    assert not sock.poll(NOTHING_ARRIVES_MS)
    assert auth.denied.wait(5) and auth.num_denied >= 1  # the stranger's key was refused
    # The keyed client still gets through after all that.
    client = dealer(ctx, address, load_keys(keys_dir, CLIENT))
    client.send(b"hello")
    assert sock.poll(5000) and sock.recv_multipart()[-1] == b"hello"


def test_client_refuses_an_impostor_server(ctx, keys_dir):
    """A peer posing as the API without its secret key never hears from a client."""
    impostor_keys = CurveKeys(SERVER, *zmq.curve_keypair(), load_keys(keys_dir, CLIENT).public)
    auth = ZapAuthenticator(ctx, impostor_keys)
    try:
        impostor = make_socket(
            ctx, zmq.ROUTER, tcp_address("127.0.0.1", 0, bind=True), bind=True, curve=impostor_keys
        )
        plain_impostor = make_socket(ctx, zmq.ROUTER, tcp_address("127.0.0.1", 0, bind=True), bind=True)
        for fake in (impostor, plain_impostor):
            client = dealer(ctx, bound_address(fake), load_keys(keys_dir, CLIENT))
            with contextlib.suppress(zmq.Again):  # as above: the refused handshake may drop the pipe first
                client.send(b"my prompt", zmq.NOBLOCK)
            assert not fake.poll(NOTHING_ARRIVES_MS)
    finally:
        auth.stop()


def test_ipc_sockets_live_in_a_folder_only_this_user_can_enter():
    folder = os.path.dirname(ipc_address("private")[len("ipc://") :])
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert os.stat(folder).st_uid == os.getuid()


def test_node_keys_are_let_in_by_name_and_a_node_uses_its_own(tmp_path):
    keys = tmp_path / "keys"
    generate_keys(keys)
    generate_node_keys(keys, "gpu1")
    with pytest.raises(ValueError, match="node name"):
        generate_node_keys(keys, "../evil")
    node_folder = tmp_path / "gpu1"
    node_folder.mkdir(mode=0o700)
    for name in ("server.key", "node-gpu1.key", "node-gpu1.key_secret"):  # what the operator copies
        (node_folder / name).write_bytes((keys / name).read_bytes())
        (node_folder / name).chmod(0o600)
    node = load_keys(node_folder, CLIENT)
    node_public, _ = zmq.auth.load_certificate(keys / "node-gpu1.key")
    assert node.public == node_public and node.peer_public == load_keys(keys, SERVER).public
    server = load_keys(keys, SERVER)
    assert server.node_keys == {node_public: "node-gpu1"} and server.peer_public  # both kinds let in
    assert stat.S_IMODE(os.stat(keys / "node-gpu1.key_secret").st_mode) == 0o600
