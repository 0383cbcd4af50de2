"""docker-compose.yml's ``pd`` profile: four services outside the default
``docker compose up``, whose commands are real invocations of our CLIs and
agree on hosts, ports and roles (parsed only; nothing starts)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from services.api.server import build_parser as serve_parser
from services.config.kv_transfer_args import resolve_kv_transfer_config
from services.kv_transfer.proxy import build_parser as proxy_parser
from services.kv_transfer.service import build_parser as service_parser
from tests.utils import compose_command

REPO = Path(__file__).resolve().parents[2]
SERVICES = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
PD = ("pd-kv-transfer", "pd-prefill", "pd-decode", "pd-proxy")
PARSERS = {"serve": serve_parser, "kv-transfer": service_parser, "pd-proxy": proxy_parser}


def parse(name: str):
    program, subcommand, *argv = SERVICES[name]["command"]
    assert program == "weft"
    return PARSERS[subcommand]().parse_args(argv)  # SystemExit on any unknown flag


def test_the_pd_services_are_in_the_pd_profile_only():
    assert all(SERVICES[name]["profiles"] == ["pd"] for name in PD)
    defaults = {name for name, service in SERVICES.items() if not service.get("profiles")}
    assert defaults == {"keys", "api", "engine-core-0", "engine-core-1"}


def test_engines_reach_the_service_in_their_roles():
    service = parse("pd-kv-transfer")
    roles = {}
    for name in ("pd-prefill", "pd-decode"):
        kv = resolve_kv_transfer_config(parse(name).kv_transfer_config)
        assert kv.kv_connector == "ZmqConnector"
        assert (kv.kv_ip, kv.kv_port) == (SERVICES["pd-kv-transfer"]["hostname"], service.port)
        roles[name] = kv.kv_role
        assert "pd-kv-transfer" in SERVICES[name]["depends_on"]
        # CurveZMQ to the service and a MAC on every block, with the service's own keys folder.
        assert kv.kv_connector_extra_config["keys_dir"] == service.zmq_curve_keys == "/keys"
    assert roles == {"pd-prefill": "kv_producer", "pd-decode": "kv_consumer"}
    assert service.host == "0.0.0.0" and not SERVICES["pd-kv-transfer"].get("ports")  # compose network only


def test_the_proxy_fronts_the_prefill_and_decode_servers():
    proxy = parse("pd-proxy")
    for urls, name in ((proxy.prefill, "pd-prefill"), (proxy.decode, "pd-decode")):
        assert urls == [f"http://{SERVICES[name]['hostname']}:{parse(name).port}"]
    assert SERVICES["pd-proxy"]["ports"] == [f"127.0.0.1:8100:{proxy.port}"]
    # The proxy vouches for kv_transfer_params with the secret both servers hold.
    secrets = {parse(name).kv_transfer_secret_file for name in ("pd-proxy", "pd-prefill", "pd-decode")}
    assert secrets == {"/keys/kv-transfer-secret"}


def test_compose_accepts_the_profile():
    base = [*compose_command(), "-f", str(REPO / "docker-compose.yml")]
    default = subprocess.run([*base, "config", "--services"], capture_output=True, text=True, check=True)
    assert set(default.stdout.split()) == {"keys", "api", "engine-core-0", "engine-core-1"}
    result = subprocess.run([*base, "--profile", "pd", "config", "-q"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
