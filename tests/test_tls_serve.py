"""TLS through a real `weft serve` (--ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs):
self-signed certificates made here with `cryptography`, the official `openai` client trusting
the server's, and a client certificate the server requires."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from benchmarks.stack import Stack

pytestmark = pytest.mark.slow


def self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for ``name`` and 127.0.0.1, and its key: (cert, key) PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


def client_context(server_cert: Path, client: tuple[Path, Path] | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(server_cert))
    if client is not None:
        context.load_cert_chain(str(client[0]), str(client[1]))
    return context


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("certs")
    return {"server": self_signed(folder, "server"), "client": self_signed(folder, "client")}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, certs):
    (server_cert, server_key), (client_cert, _) = certs["server"], certs["client"]
    stack = Stack(
        [
            "--ssl-certfile",
            str(server_cert),
            "--ssl-keyfile",
            str(server_key),
            "--ssl-ca-certs",
            str(client_cert),  # the client's self-signed certificate is its own CA
            "--ssl-cert-reqs",
            str(int(ssl.CERT_REQUIRED)),
            "--max-model-len",
            "512",
            "--num-threads",
            "1",
            "--num-gpu-blocks-override",
            "64",
        ],
        tmp_path_factory.mktemp("logs"),
        tls={"verify": client_context(server_cert, certs["client"])},
    )
    try:
        stack.wait_healthy()
        yield stack
    finally:
        stack.kill()


def _complete(stack: Stack, context: ssl.SSLContext | bool) -> str:
    with openai.OpenAI(
        base_url=f"{stack.url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=120,
        http_client=httpx.Client(verify=context),
    ) as client:
        completion = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=3, temperature=0.0
        )
    return completion.choices[0].text


def test_openai_client_trusting_the_certificate_completes(stack, certs):
    assert stack.url.startswith("https://")
    assert _complete(stack, client_context(certs["server"][0], certs["client"]))


def test_a_client_that_does_not_trust_the_server_is_refused(stack, certs):
    with pytest.raises(openai.APIConnectionError):
        _complete(stack, ssl.create_default_context())  # the system CAs only


def test_a_client_without_a_certificate_is_refused(stack, certs):
    with pytest.raises(openai.APIConnectionError):
        _complete(stack, client_context(certs["server"][0], None))


def test_plain_http_gets_no_answer(stack):
    with pytest.raises(httpx.TransportError):
        httpx.get(stack.url.replace("https://", "http://") + "/ping", timeout=10)
