"""The two images' Dockerfiles, linted without a Docker engine: parsed by
BuildKit's own parser (the `dockerfile` package), their install steps name
files and make targets that exist, the CPU image installs the runtime lock
only, the GPU image is on an official CUDA base whose CUDA version is the
torch index's, installs the torch the README's GPU recipe installs before
`make install` (which keeps it), and can run scripts/gpu_check.sh."""

from __future__ import annotations

import importlib.util
import re

import dockerfile
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from services.api.server import build_parser as serve_parser
from tests.utils import REPO_ROOT

IMAGES = ("Dockerfile", "Dockerfile.cuda")


def parse(name: str) -> list[dockerfile.Command]:
    return list(dockerfile.parse_file(str(REPO_ROOT / name)))


def runs(commands) -> str:
    return "\n".join(c.value[0] for c in commands if c.cmd == "RUN")


def args_of(commands) -> dict[str, str]:
    return dict(c.value[0].split("=", 1) for c in commands if c.cmd == "ARG" and "=" in c.value[0])


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (REPO_ROOT / "Makefile").read_text(), re.M))


def locked_names(*locks: str) -> set[str]:
    names = set()
    for lock in locks:
        for line in (REPO_ROOT / lock).read_text().splitlines():
            if line and not line.startswith("#"):
                names.add(canonicalize_name(Requirement(line).name))
    return names


@pytest.mark.parametrize("name", IMAGES)
def test_the_image_is_built_from_this_repository_and_runs_as_a_user(name):
    commands = parse(name)
    assert commands[0].cmd == "FROM"
    for copy in (c for c in commands if c.cmd == "COPY"):
        *sources, _ = [v for v in copy.value]
        assert all((REPO_ROOT / s).exists() for s in sources), copy
    users = [i for i, c in enumerate(commands) if c.cmd == "USER"]
    cmd = next(i for i, c in enumerate(commands) if c.cmd == "CMD")
    assert users and commands[users[-1]].value[0] not in ("root", "0") and users[-1] < cmd
    # Everything is installed as that user: no RUN after it needs root.
    assert all(c.cmd != "RUN" or "apt-get" not in c.value[0] for c in commands[users[-1] :])


@pytest.mark.parametrize("name", IMAGES)
def test_install_steps_name_what_exists(name):
    script = runs(parse(name))
    for target in re.findall(r"(?:^|&&|;|then)\s*make ((?:[\w=-]+ ?)+)", script, re.M):
        for word in target.split():
            if "=" not in word:
                assert word in make_targets(), (name, word)
    assert re.search(r"(?:^|&&)\s*make install", script, re.M), name
    for path in re.findall(r"\b((?:requirements[\w-]*\.lock)|(?:scripts/\S+))", script):
        assert (REPO_ROOT / path).exists(), (name, path)


@pytest.mark.parametrize("name", IMAGES)
def test_the_command_is_a_real_weft_invocation(name):
    (cmd,) = [c for c in parse(name) if c.cmd == "CMD"]
    assert cmd.json  # exec form: weft is PID 1 and gets SIGTERM itself
    program, subcommand, *argv = cmd.value
    assert (program, subcommand) == ("weft", "serve")
    args = serve_parser().parse_args(argv)
    assert args.host == "0.0.0.0" and args.port == 8000
    assert args.device == ("cuda" if name.endswith(".cuda") else "auto")


def test_the_cpu_image_installs_the_runtime_lock_only():
    script = runs(parse("Dockerfile"))
    assert "make install model" in script
    assert "install-dev" not in script and "requirements-dev.lock" not in script and ".[test]" not in script


def test_the_gpu_image_has_an_official_cuda_base_and_the_recipes_torch():
    commands = parse("Dockerfile.cuda")
    base = commands[0].value[0]
    match = re.fullmatch(
        r"nvidia/cuda:(\d+)\.(\d+)\.\d+-(?:base|runtime|devel)(?:-cudnn)?-ubuntu\d+\.\d+", base
    )
    assert match, base
    args = args_of(commands)
    # The torch index's CUDA version is the base image's.
    assert args["TORCH_INDEX"] == f"https://download.pytorch.org/whl/cu{match[1]}{match[2]}"
    # The torch of the README's GPU recipe and of the Makefile (less its +cpu), from the same index.
    readme = (REPO_ROOT / "README.md").read_text()
    assert f"{args['TORCH']} --index-url {args['TORCH_INDEX']}" in readme
    makefile_torch = re.search(r"^TORCH \?= (\S+)$", (REPO_ROOT / "Makefile").read_text(), re.M)[1]
    assert makefile_torch.split("+")[0] == args["TORCH"]
    # torch first, then `make install`, which keeps a torch that imports.
    script = runs(commands)
    assert script.index('--index-url "$TORCH_INDEX" "$TORCH"') < script.index("make install")
    assert '-c "import torch" 2>/dev/null ||' in (REPO_ROOT / "Makefile").read_text()


def test_the_gpu_image_can_run_the_gpu_check():
    """With --build-arg DEV=1 it has every module scripts/gpu_check.sh checks for, on PATH's python3."""
    commands = parse("Dockerfile.cuda")
    assert args_of(commands)["DEV"] == "0"
    assert 'if [ "$DEV" = 1 ]; then make install-dev' in runs(commands)
    env = {c.value[0]: c.value[1] for c in commands if c.cmd == "ENV"}
    assert env["PATH"].startswith("/app/.venv/bin:")  # gpu_check.sh runs `python3`: the venv's
    spec = importlib.util.spec_from_file_location("setup", REPO_ROOT / "scripts" / "gpu_check_setup.py")
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)
    modules = setup.CHECK_IMPORTS  # what the check's set-up step makes sure it can import
    dist = {"zmq": "pyzmq", "yaml": "pyyaml", "ahocorasick": "pyahocorasick"}
    available = locked_names("requirements.lock", "requirements-dev.lock")
    assert {canonicalize_name(dist.get(m, m)) for m in modules} <= available
