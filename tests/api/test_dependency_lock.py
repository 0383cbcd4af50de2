"""requirements.lock (what `make install` installs) agrees with pyproject.toml,
and neither lets in a release with a known hole."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
# Kept out of the lock: a GPU user keeps the CUDA torch they installed first.
UNLOCKED = {"torch"}
# name -> (the first safe release, the last one with a known hole that matters here).
SAFE_FLOORS = {
    "jinja2": ("3.1.6", "3.1.5"),  # sandbox escapes: CVE-2024-56201, CVE-2025-27516
    "h11": ("0.16.0", "0.14.0"),  # request smuggling: CVE-2025-43859
    "starlette": ("0.47.2", "0.47.1"),
}  # multipart DoS: CVE-2024-47874, CVE-2025-54121


def requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]


def locked() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = Version(version.strip())
    return pins


def test_every_dependency_is_locked_within_its_bounds():
    pins = locked()
    for req in requirements():
        name = canonicalize_name(req.name)
        if name in UNLOCKED:
            assert name not in pins
            continue
        assert name in pins, f"{req.name} is not in requirements.lock (regenerate it, see its header)"
        assert req.specifier.contains(pins[name], prereleases=True), (req, pins[name])


@pytest.mark.parametrize("name, safe, vulnerable", [(n, s, v) for n, (s, v) in sorted(SAFE_FLOORS.items())])
def test_vulnerable_releases_are_excluded(name, safe, vulnerable):
    req = next(r for r in requirements() if canonicalize_name(r.name) == name)
    assert not req.specifier.contains(vulnerable) and req.specifier.contains(safe), req
    assert locked()[name] >= Version(safe)
