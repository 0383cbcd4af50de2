"""docker-compose.yml: it parses, and every service's command is a real CLI
invocation of this project (parsed by our own argparse parsers; nothing starts)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from services.api.server import build_parser as serve_parser
from services.engine_core.cli import parse_args as engine_core_args
from tests.utils import compose_command

REPO = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
# What plain `docker compose up` starts: the services outside any profile
# (the `pd` profile is tested in tests/kv_transfer/test_compose_pd.py).
DEFAULT_SERVICES = {name: s for name, s in COMPOSE["services"].items() if not s.get("profiles")}


@pytest.fixture(autouse=True)
def compose_keys_folder(monkeypatch, tmp_path):
    """The compose services load their CURVE keys from /keys, a volume the
    `keys` service fills: parse against a real `weft keys` folder instead."""
    from protocol import curve

    keys = tmp_path / "keys"
    curve.generate_keys(keys)
    real = curve.load_keys
    monkeypatch.setattr(
        curve, "load_keys", lambda folder, role: real(keys if str(folder) == "/keys" else folder, role)
    )


def parse_command(command: list[str]):
    """Parse one compose ``command`` with the parser of the program it runs."""
    program, *argv = command
    if program == "weft":
        assert argv[0] == "serve", f"unexpected weft subcommand {argv[0]!r}"
        return serve_parser().parse_args(argv[1:])
    if program == "engine-core":
        return engine_core_args(argv)
    raise AssertionError(f"{program!r} is not a command of this project")


SERVING = ("api", "engine-core-0", "engine-core-1")


def test_services_and_shared_image():
    services = DEFAULT_SERVICES
    assert set(services) == {"keys", *SERVING}
    assert services["api"]["build"] == "."
    assert {s["image"] for s in services.values()} == {services["api"]["image"]}
    assert services["api"]["ports"] == ["127.0.0.1:8000:8000"]  # the host's loopback only
    for name in SERVING:
        assert any(volume.split(":")[0] == "models" for volume in services[name]["volumes"])
    assert "models" in COMPOSE["volumes"] and "keys" in COMPOSE["volumes"]


def test_only_loopback_ports_are_published():
    for name, service in COMPOSE["services"].items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
            assert not port.endswith((":29550", ":14579")), f"{name} publishes an engine or KV port"


def test_a_one_shot_keys_service_puts_keys_in_place_before_anything_starts():
    keys = COMPOSE["services"]["keys"]
    script = keys["command"][-1]
    assert keys["restart"] == "no" and "keys:/keys" in keys["volumes"]
    assert "umask 077" in script and "weft keys --dir /keys" in script
    assert "secret api-key" in script and "kv-transfer-secret" in script
    for name, service in COMPOSE["services"].items():
        if name == "keys" or service.get("image") != keys["image"]:
            continue  # third-party images (the monitoring profile): see tests/test_compose_secrets.py
        assert service["depends_on"]["keys"]["condition"] == "service_completed_successfully", name
        # One role's folder, read-only; the volume of every key is `keys`' alone.
        mounts = [v for v in service["volumes"] if v.split(":")[1] == "/keys"]
        assert len(mounts) == 1 and mounts[0].endswith(":ro") and mounts[0].startswith("keys-"), name


@pytest.mark.parametrize("name", SERVING)
def test_the_links_are_curve_and_the_api_has_a_key(name):
    args = parse_command(COMPOSE["services"][name]["command"])
    assert args.zmq_curve_keys == "/keys"
    if name == "api":
        # The key comes from its file into the environment (weft serve reads $WEFT_API_KEY), not argv.
        assert args.api_key is None
        assert "WEFT_API_KEY=" in " ".join(COMPOSE["services"]["api"]["entrypoint"])


def test_the_image_runs_as_a_user_without_privileges():
    lines = [
        line.strip()
        for line in (REPO / "Dockerfile").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    last_user = max(i for i, line in enumerate(lines) if line.startswith("USER "))
    first_cmd = min(i for i, line in enumerate(lines) if line.startswith(("CMD", "ENTRYPOINT")))
    assert last_user < first_cmd


@pytest.mark.parametrize("name", SERVING)
def test_command_is_a_real_cli_invocation(name):
    command = COMPOSE["services"][name]["command"]
    assert isinstance(command, list) and all(isinstance(part, str) for part in command)
    parse_command(command)  # argparse exits (SystemExit) on anything it does not know


def test_api_and_engines_agree_on_the_data_parallel_layout():
    api = parse_command(COMPOSE["services"]["api"]["command"])
    assert api.data_parallel_size == 2 and api.data_parallel_size_local == 0
    assert (api.host, api.port) == ("0.0.0.0", 8000)
    ranks = []
    for name in ("engine-core-0", "engine-core-1"):
        engine = parse_command(COMPOSE["services"][name]["command"])
        assert engine.headless and engine.data_parallel_size == api.data_parallel_size
        assert engine.data_parallel_address == "api" == api.data_parallel_address
        assert engine.data_parallel_rpc_port == api.data_parallel_rpc_port
        ranks += range(engine.start_rank, engine.start_rank + engine.data_parallel_size_local)
    assert sorted(ranks) == [0, 1]


def test_a_wrong_flag_is_caught():
    with pytest.raises(SystemExit):
        parse_command(["engine-core", "--headless", "--data-parallel-size", "2", "--no-such-flag"])


def test_compose_config_accepts_the_file():
    result = subprocess.run(
        [*compose_command(), "-f", str(REPO / "docker-compose.yml"), "config", "-q"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_compose_config_rejects_a_broken_file(tmp_path: Path):
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("services:\n  api:\n    image: weft\n    ports: 8000\n")  # ports must be a list
    result = subprocess.run(
        [*compose_command(), "-f", str(broken), "config", "-q"], capture_output=True, text=True
    )
    assert result.returncode != 0 and "ports" in result.stderr


async def test_engines_get_data_addresses_on_the_handshake_host():
    """With compose, the API binds its handshake on its hostname (``api``):
    the data addresses it hands out must name a host engines can reach there,
    never a wildcard. ``localhost`` stands in for ``api`` here."""
    from services.api.dp_client import DPLBEngineClient
    from services.config.engine_args import EngineArgs

    config = EngineArgs(data_parallel_size=2).create_engine_config()
    client = DPLBEngineClient(config, "tcp://localhost:*", num_ranks=2)
    await client.start()
    try:
        # What the handshake reply carries to every engine.
        for address in (client.handshake_address, client.input_address, client.output_address):
            assert address.startswith("tcp://127.0.0.1:") and not address.endswith(":*"), address
    finally:
        await client.shutdown()
