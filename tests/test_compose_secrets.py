"""docker-compose.yml hands each service only the secrets it needs, restarts
what should run for ever, checks health on /health, and the README's compose
commands (read the generated API key, curl with it) fit the file.

The `keys` service's script runs here for real (as compose resolves it, with
its folders moved under a temporary one and `weft` this checkout's CLI); then
each role's folder is loaded as that role's process loads it, and what it must
not hold is absent. Nothing else starts: no Docker engine is needed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.curve import CLIENT, SERVER, load_keys
from services.kv_transfer.keys import mac_key
from tests.utils import REPO_ROOT, compose_command

ROLE_OF = {  # service -> the keys volume it mounts
    "api": "keys-api",
    "engine-core-0": "keys-engine",
    "engine-core-1": "keys-engine",
    "pd-kv-transfer": "keys-kv-transfer",
    "pd-prefill": "keys-pd-server",
    "pd-decode": "keys-pd-server",
    "pd-proxy": "keys-pd-proxy",
    "grafana": "keys-grafana",
}
LONG_RUNNING = (*ROLE_OF, "prometheus")


@pytest.fixture(scope="module")
def compose() -> dict:
    """The file as compose resolves it (anchors merged, `$$` unescaped), every profile on."""
    result = subprocess.run(
        [*compose_command(), "-f", str(REPO_ROOT / "docker-compose.yml"), "--profile", "*"]
        + ["config", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout)


def volume_at(service: dict, target: str) -> str | None:
    return next((v["source"] for v in service.get("volumes", []) if v["target"] == target), None)


@pytest.fixture(scope="module")
def role_folders(compose, tmp_path_factory) -> dict[str, Path]:
    """Run the keys service's script; return each role volume's folder, as the keys service fills it."""
    root = tmp_path_factory.mktemp("compose-keys")
    keys = compose["services"]["keys"]
    folders = {
        v["source"]: root / ("master" if v["target"] == "/keys" else v["target"].lstrip("/"))
        for v in keys["volumes"]
    }
    for folder in folders.values():
        folder.mkdir(mode=0o700, parents=True)
    assert {v["target"] for v in keys["volumes"]} - {"/keys"} == {
        f"/roles/{f.name}" for f in folders.values() if f.name != "master"
    }
    # `compose config` keeps `$$` (compose's escape of `$`); the container's shell sees one `$`.
    script = keys["command"][2].replace("$$", "$")
    script = script.replace("/keys", str(root / "master")).replace("/roles/", f"{root}/roles/")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    (bin_dir / "weft").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m services.cli "$@"\n')
    (bin_dir / "python").symlink_to(sys.executable)
    (bin_dir / "weft").chmod(0o755)
    env = os.environ | {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run(["sh", "-c", script], check=True, env=env, timeout=120)
    # A second start keeps the keys and rewrites the roles' shares from them.
    first = (root / "master" / "api-key").read_text()
    subprocess.run(["sh", "-c", script], check=True, env=env, timeout=120)
    assert (root / "master" / "api-key").read_text() == first
    return folders


def files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_each_service_mounts_only_its_roles_folder(compose):
    for name, service in compose["services"].items():
        if name == "keys":
            continue
        sources = {v.get("source") for v in service.get("volumes", [])}
        assert "keys" not in sources, f"{name} mounts every key"
        if name in ROLE_OF:
            mount = next(v for v in service["volumes"] if v["target"] == "/keys")
            assert mount["source"] == ROLE_OF[name] and mount["read_only"], name
        else:
            assert not any(s and s.startswith("keys") for s in sources), name


def test_the_api_holds_the_server_keypair_and_the_api_key(role_folders):
    api = role_folders["keys-api"]
    assert files(api) == {"server.key", "server.key_secret", "client.key", "api-key"}
    assert load_keys(api, SERVER).peer_public  # it authenticates the engines' key
    with pytest.raises(ValueError):
        load_keys(api, CLIENT)  # no engine secret key


def test_engines_hold_neither_the_servers_secret_key_nor_the_api_key(role_folders):
    engine = role_folders["keys-engine"]
    assert files(engine) == {"client.key", "client.key_secret", "server.key"}
    assert load_keys(engine, CLIENT).peer_public == load_keys(role_folders["keys-api"], SERVER).public


def test_kv_transfer_cannot_seal_blocks(role_folders):
    service = role_folders["keys-kv-transfer"]
    assert "client.key_secret" not in files(service)
    load_keys(service, SERVER)
    with pytest.raises(ValueError):
        mac_key(service)  # it stores blocks it cannot forge


def test_the_pd_servers_seal_blocks_and_the_proxy_holds_its_secret_alone(role_folders):
    pd = role_folders["keys-pd-server"]
    assert mac_key(pd) == mac_key(role_folders["keys-engine"])
    assert "server.key_secret" not in files(pd)
    assert files(role_folders["keys-pd-proxy"]) == {"kv-transfer-secret"}
    secret = (role_folders["keys-pd-proxy"] / "kv-transfer-secret").read_text()
    assert secret == (pd / "kv-transfer-secret").read_text() and len(secret.strip()) >= 32


def test_secrets_are_private_and_grafana_reads_its_password_only(role_folders, compose):
    for role, folder in role_folders.items():
        for path in folder.iterdir():
            mode = stat.S_IMODE(path.stat().st_mode)
            if role == "keys-grafana":
                continue
            assert not mode & 0o077, (role, path.name, oct(mode))
    assert files(role_folders["keys-grafana"]) == {"grafana-admin-password"}
    env = compose["services"]["grafana"]["environment"]
    assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/keys/grafana-admin-password"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env  # not admin/admin, nor a password in the file


def test_restart_policies_and_health_checks(compose):
    services = compose["services"]
    assert services["keys"]["restart"] == "no"
    for name in LONG_RUNNING:
        assert services[name]["restart"] == "unless-stopped", name
    for name in ("api", "pd-prefill", "pd-decode", "pd-proxy"):
        check = services[name]["healthcheck"]
        assert "http://127.0.0.1:8000/health" in " ".join(check["test"]), name
        parsed = [p for p in (services[name]["command"]) if p.startswith("--port")]
        assert services[name]["command"][services[name]["command"].index("--port") + 1] == "8000", parsed
    # The proxy starts once both servers answer /health.
    assert {
        d["condition"] for d in (services["pd-proxy"]["depends_on"][s] for s in ("pd-prefill", "pd-decode"))
    } == {"service_healthy"}


def readme_compose_commands() -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
    section = text.split("\n## Docker Compose\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_readmes_commands_read_the_key_the_api_uses(compose, role_folders):
    """`docker compose run --rm -T keys cat /keys/api-key`: the keys service mounts the volume that
    holds it at /keys, and the API reads the same key (its share) into $WEFT_API_KEY."""
    commands = readme_compose_commands()
    assert commands[0].strip() == "docker compose up -d"
    key_line = next(c for c in commands if "keys cat" in c)
    argv = shlex.split(re.search(r"\$\((.*)\)", key_line).group(1))
    assert argv[:4] == ["docker", "compose", "run", "--rm"] and "-T" in argv  # -T: no \r from a TTY
    service, *command = argv[argv.index("keys") :]
    assert service == "keys" and command[0] == "cat"
    path = Path(command[1])
    source = volume_at(compose["services"]["keys"], str(path.parent))
    assert (role_folders[source] / path.name).read_text() == (
        role_folders["keys-api"] / "api-key"
    ).read_text()
    entrypoint = " ".join(compose["services"]["api"]["entrypoint"]).replace("$$", "$")
    assert 'WEFT_API_KEY="$(cat /keys/api-key)"' in entrypoint
    assert volume_at(compose["services"]["api"], "/keys") == "keys-api"
    curl = next(c for c in commands if c.startswith("curl") and "/v1/" in c)
    assert '-H "Authorization: Bearer $KEY"' in curl and "localhost:8000" in curl
    published = compose["services"]["api"]["ports"][0]
    assert (published["host_ip"], published["published"]) == ("127.0.0.1", "8000")
    assert any("localhost:8000/health" in c for c in commands)


def test_the_image_owns_every_folder_the_keys_service_writes(compose):
    """Docker seeds a new named volume with the image folder's owner and mode: each folder the keys
    service mounts a volume on must exist in the image, owned by its user (else it cannot write)."""
    import dockerfile

    runs = " ".join(
        c.value[0] for c in dockerfile.parse_file(str(REPO_ROOT / "Dockerfile")) if c.cmd == "RUN"
    )
    made = set(re.search(r"mkdir -p ([^&]+)&&", runs)[1].split())
    owned = re.search(r"chown -R weft:weft ([^&]+)(?:&&|$)", runs)[1].split()
    for volume in compose["services"]["keys"]["volumes"]:
        target = volume["target"]
        assert target in made and any(target == o or target.startswith(o + "/") for o in owned), target
