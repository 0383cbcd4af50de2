"""The operator plumbing in process (a fake engine): /ping beside /health, X-Request-Id's checks,
the OpenAPI document, the flags' own checks, and `weft --help`. The same features through a
real `weft serve` are in tests/test_operator_serve.py and tests/test_tls_serve.py."""

from __future__ import annotations

import argparse
import asyncio
import re
import ssl

import pytest
from openapi_spec_validator import validate

from benchmarks.bench.cli import OWN_PARSERS, SUBCOMMANDS
from services import cli
from services.api.engine_client import RankStats
from services.api.openapi import openapi_document
from services.api.operator_options import add_operator_args, operator_options, tls_options
from services.api.request_id import MAX_REQUEST_ID_CHARS
from services.engine_core.cli import parse_args as engine_core_args
from tests.api.fake_engine_client import MODEL_NAME, FakeEngineClient, http_client, make_app
from tests.utils import REPO_ROOT

BODY = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3}


async def test_ping_answers_while_health_says_not_ready():
    engine = FakeEngineClient()
    engine.ranks[0] = RankStats(0, state="waiting")
    client = http_client(make_app(engine)[0])
    assert (await client.get("/health")).status_code == 503
    ping = await client.get("/ping")
    assert ping.status_code == 200 and ping.json() == {"status": "alive"}


async def test_request_id_is_echoed_and_becomes_the_completion_id():
    client = http_client(make_app()[0])
    given = await client.post("/v1/completions", json=BODY, headers={"X-Request-Id": "order-7.a:b_c"})
    assert given.headers["x-request-id"] == "order-7.a:b_c" and given.json()["id"] == "cmpl-order-7.a:b_c"
    made = await client.post("/v1/completions", json=BODY)
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
    assert made.json()["id"] == "cmpl-" + made.headers["x-request-id"]
    assert (await client.get("/v1/models")).headers["x-request-id"]  # every route, not only completions


async def test_a_stored_response_keeps_an_id_of_the_servers_own():
    client = http_client(make_app()[0])
    body = {"model": MODEL_NAME, "input": "Hello", "max_output_tokens": 3}
    response = await client.post("/v1/responses", json=body, headers={"X-Request-Id": "chosen"})
    assert response.headers["x-request-id"] == "chosen"
    assert re.fullmatch(r"resp_[0-9a-f]{32}", response.json()["id"])


async def test_two_requests_may_send_the_same_id():
    app, engine = make_app()
    client = http_client(app)
    both = await asyncio.gather(
        *(client.post("/v1/completions", json=BODY, headers={"X-Request-Id": "same"}) for _ in range(2))
    )
    assert [r.status_code for r in both] == [200, 200]
    assert len({r.request_id for r in engine.requests}) == 2  # the engine requests stay distinct


@pytest.mark.parametrize(
    "bad", ["", "has space", "semi;colon", "slash/x", "é", "x" * (MAX_REQUEST_ID_CHARS + 1)]
)
async def test_a_bad_request_id_is_a_400_naming_the_header(bad):
    app, engine = make_app()
    response = await http_client(app).post(
        "/v1/completions", json=BODY, headers=[(b"x-request-id", bad.encode())]
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "X-Request-Id"
    assert engine.requests == []


def test_openapi_document_is_valid_3_1_and_lists_every_route():
    app, _ = make_app()
    document = openapi_document(app.routes, "0", "/weft")
    validate(document)  # OpenAPI 3.1 (the version the document declares)
    listed = {(path, method.upper()) for path, ops in document["paths"].items() for method in ops}
    served = {
        (route.path.replace("{model:path}", "{model}"), method)
        for route in app.routes
        for method in route.methods - {"HEAD"}
    }
    assert listed == served and ("/ping", "GET") in listed and ("/openapi.json", "GET") in listed
    completions = document["paths"]["/v1/completions"]["post"]
    assert completions["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"
    }
    assert "prompt" in document["components"]["schemas"]["CompletionRequest"]["properties"]


def _operator_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_operator_args(parser)
    return parser.parse_args(list(argv))


def test_cors_lists_take_json_as_vllm_does_or_commas():
    options = operator_options(
        _operator_args("--allowed-origins", '["http://a", "http://b"]', "--allowed-methods", "GET, POST")
    )
    assert options.allowed_origins == ("http://a", "http://b") and options.allowed_methods == ("GET", "POST")
    assert operator_options(_operator_args()).allowed_origins == ()  # no origin unless given


@pytest.mark.parametrize("root", ["weft", "/a b", "/x?y", "/<script>"])
def test_a_root_path_must_be_a_plain_path(root):
    with pytest.raises(ValueError, match="--root-path"):
        operator_options(_operator_args("--root-path", root))


def test_tls_flags_are_checked_before_serving(tmp_path):
    assert tls_options(_operator_args()) == {}
    with pytest.raises(ValueError, match="go together"):
        tls_options(_operator_args("--ssl-certfile", "cert.pem"))
    with pytest.raises(ValueError, match="not a readable file"):
        tls_options(
            _operator_args("--ssl-keyfile", str(tmp_path / "no"), "--ssl-certfile", str(tmp_path / "no"))
        )
    with pytest.raises(ValueError, match="needs --ssl-ca-certs"):
        tls_options(_operator_args("--ssl-keyfile", "k", "--ssl-certfile", "c", "--ssl-cert-reqs", "2"))
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    key.write_text("k"), cert.write_text("c")
    assert tls_options(_operator_args("--ssl-keyfile", str(key), "--ssl-certfile", str(cert))) == {
        "ssl_keyfile": str(key),
        "ssl_certfile": str(cert),
        "ssl_cert_reqs": ssl.CERT_NONE,
    }


def test_otlp_endpoint_must_be_a_url():
    with pytest.raises(ValueError, match="http"):
        operator_options(_operator_args("--otlp-traces-endpoint", "collector:4318"))


def test_headless_engine_cores_take_the_log_format_too():
    argv = ["--headless", "--data-parallel-size", "1", "--data-parallel-address", "10.0.0.1"]
    argv += ["--data-parallel-rpc-port", "29550", "--log-format", "json"]
    assert engine_core_args(argv).log_format == "json"


def test_weft_help_lists_every_subcommand_and_benchmark(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in [*cli.COMMANDS, *SUBCOMMANDS, *OWN_PARSERS]:
        assert re.search(rf"^  {re.escape(name)} ", out, re.MULTILINE), name


def test_the_configuration_doc_names_every_operator_flag():
    parser = argparse.ArgumentParser()
    add_operator_args(parser)
    readme = (REPO_ROOT / "docs" / "configuration.md").read_text()  # the README links it
    flags = [a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"]
    assert flags and [f for f in flags if f"`{f}" not in readme] == []
    assert "`/ping`" in readme and "`/openapi.json`" in readme and "X-Request-Id" in readme
