"""`pip install .` into a fresh virtualenv gives working `weft` and
`engine-core` commands with the runtime dependencies alone.

Offline and quick: weft is built into a wheel (from a copy of the sources,
nothing is written into the checkout) and installed into a new virtualenv by
pip; the runtime packages are those of requirements.lock (plus torch), made
visible to that virtualenv from this one's installed files through a folder of
links, and nothing else: no pytest, no openai, no ruff, no checkout on the
path. A command importing a package the runtime lock lacks fails here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.utils import REPO_ROOT

SOURCES = ("pyproject.toml", "README.md", "LICENSE", "protocol", "kernels", "services", "benchmarks")


def runtime_distributions() -> list[str]:
    names = ["torch"]
    for line in (REPO_ROOT / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            names.append(Requirement(line).name)
    return names


def link_runtime_packages(target: Path) -> None:
    """Link every top-level file or folder the runtime distributions installed (their
    dist-info included, so importlib.metadata finds their versions) into ``target``."""
    target.mkdir()
    for name in runtime_distributions():
        dist = metadata.distribution(name)
        site = Path(dist.locate_file(""))
        for top in {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            link = target / top
            if not link.exists() and (site / top).exists():
                link.symlink_to(site / top)


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("packaging")
    source = work / "src"
    source.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (REPO_ROOT / name).is_dir() else shutil.copy2
        copy(
            REPO_ROOT / name,
            source / name,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}),
        )
    pip = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", "-q"]
    wheels = work / "wheels"
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, source], check=True)
    (wheel,) = wheels.glob("weft-*.whl")
    venv = work / "venv"
    # No pip of its own (seeding one costs seconds): this pip installs into it (--python).
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    # Without this checkout on PYTHONPATH: its weft.egg-info would read as weft installed already.
    subprocess.run(
        [*pip, "--python", python, "install", "--no-deps", "--no-index", wheel], check=True, env=clean_env()
    )
    link_runtime_packages(work / "runtime")
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site / "runtime-packages.pth").write_text(str(work / "runtime") + "\n")
    return venv


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return env | {"OMP_NUM_THREADS": "1"}


def run(venv: Path, *argv: str) -> subprocess.CompletedProcess:
    command = [str(venv / "bin" / argv[0]), *argv[1:]]
    return subprocess.run(command, capture_output=True, text=True, env=clean_env(), cwd=venv, timeout=300)


def test_weft_serve_help_runs_with_the_runtime_packages_only(fresh_venv):
    result = run(fresh_venv, "weft", "serve", "--help")
    assert result.returncode == 0, result.stderr
    assert "--model" in result.stdout and "--kv-transfer-config" in result.stdout


def test_the_installed_commands_are_the_wheels_not_the_checkouts(fresh_venv):
    result = run(fresh_venv, "python", "-c", "import services, pytest")
    assert result.returncode != 0 and "No module named 'pytest'" in result.stderr  # no test package
    result = run(fresh_venv, "python", "-c", "import services; print(services.__file__)")
    assert result.returncode == 0 and str(REPO_ROOT) not in result.stdout, result.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ("engine-core", "--help"),
        ("weft", "pd-proxy", "--help"),
        ("weft", "kv-transfer", "--help"),
        ("weft", "--help"),
        ("weft", "bench", "throughput", "--help"),
    ],
)
def test_every_command_starts(fresh_venv, argv):
    result = run(fresh_venv, *argv)
    assert result.returncode == 0, result.stderr


def test_the_installed_benchmarks_carry_their_workloads_and_peer_scripts(fresh_venv):
    code = (
        "from benchmarks import BENCHMARKS_DIR; from benchmarks.bench.workload import load_workload, "
        "resolve_dataset; print(len(load_workload(resolve_dataset('smoke-8')).requests)); "
        "print(sorted(p.name for p in (BENCHMARKS_DIR / 'peers').glob('*.py'))); "
        "print((BENCHMARKS_DIR / 'scripts').exists(), (BENCHMARKS_DIR / 'results').exists())"
    )
    result = run(fresh_venv, "python", "-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == ["8", "['llamacpp_server.py', 'vllm_offline.py']", "False False"]
