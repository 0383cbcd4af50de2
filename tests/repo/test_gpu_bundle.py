"""The GPU check's bundle and script, checked here: what the check imports is on the device image
or in the bundle (resolved against the packages' metadata), and its steps fit 8 minutes.

The download (``make gpu-bundle``, PyPI) is never run here; where a bundle was made, its wheels are
checked against the list too.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import re
import sys

import pytest
from packaging.requirements import Requirement

from tests.utils import REPO_ROOT

# The code the check runs: weft itself and `weft bench gpu`, the kernel tests and the helpers they
# import, its scripts.
CHECK_CODE = (
    "services",
    "protocol",
    "kernels",
    "benchmarks/__init__.py",
    "benchmarks/stack.py",
    "benchmarks/bench",
    "tests/kernels",
    "tests/conftest.py",
    "tests/utils.py",
    "tests/polling.py",
    "tests/tiny_model.py",
    "scripts/gpu_check_setup.py",
)
LOCAL = {"services", "protocol", "kernels", "benchmarks", "tests", "scripts"}
# Imported somewhere in that code, on paths the check never takes.
OFF_THE_CHECK_PATH = {
    "matplotlib": "weft bench plots",
    "opentelemetry": "--otlp-traces-endpoint only (services/api/tracing.py), not given by the check",
}
# Markers as the device's Python sees them.
DEVICE_ENV = {"python_version": "3.12", "sys_platform": "linux", "platform_system": "Linux",
              "platform_machine": "x86_64", "implementation_name": "cpython", "extra": ""}  # fmt: skip


def load_bundle_module():
    spec = importlib.util.spec_from_file_location("gpu_bundle", REPO_ROOT / "scripts" / "gpu_bundle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bundle = load_bundle_module()


def imported_modules() -> set[str]:
    names = set()
    for root in CHECK_CODE:
        path = REPO_ROOT / root
        for file in [path] if path.is_file() else path.rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.Import):
                    names |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in LOCAL}


def requirements_of(distribution: str) -> list[str]:
    found = []
    for line in md.distribution(distribution).requires or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate(DEVICE_ENV):
            found.append(bundle.normalized(requirement.name))
    return found


def closure(distributions, *, installed_only: bool = False) -> set[str]:
    """The distributions and everything they require, transitively. ``installed_only``: a name not
    installed here (the image's pytest-xdist) counts without its requirements."""
    seen, stack = set(), [bundle.normalized(d) for d in distributions]
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            try:
                stack += requirements_of(name)
            except md.PackageNotFoundError:
                if not installed_only:
                    raise
    return seen


def test_the_bundle_covers_every_module_the_check_imports():
    by_module = md.packages_distributions()
    modules = imported_modules() - set(OFF_THE_CHECK_PATH)
    unknown = sorted(m for m in modules if m not in by_module)
    assert not unknown, f"imported by the check but installed nowhere here: {unknown}"
    needed = closure({by_module[m][0] for m in modules} | set(bundle.CHECK_EXTRA))
    present = closure(bundle.IMAGE, installed_only=True) | {bundle.normalized(n) for n in bundle.BUNDLE}
    assert needed - present == set(), "the device image lacks these and the bundle does not bring them"
    # Every wheel of the bundle is pinned by the lock, so the device runs the versions tested here.
    assert len(bundle.pinned_bundle()) == len(bundle.BUNDLE)
    assert {"xgrammar", "msgspec", "pyzmq", "starlette", "uvicorn", "openai"} <= set(bundle.BUNDLE)


def test_the_setup_step_imports_only_what_the_image_or_bundle_holds():
    spec = importlib.util.spec_from_file_location("setup", REPO_ROOT / "scripts" / "gpu_check_setup.py")
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)
    by_module = md.packages_distributions()
    brought = {bundle.normalized(n) for n in bundle.BUNDLE}
    assert all(bundle.normalized(by_module[m][0]) in brought for m in setup.CHECK_IMPORTS)


def test_the_check_steps_fit_eight_minutes():
    script = (REPO_ROOT / "scripts" / "gpu_check.sh").read_text()
    limits = dict(
        entry.split(":") for entry in re.search(r"^LIMITS=\((.*)\)$", script, re.M).group(1).split()
    )
    kill_after = int(re.search(r"^KILL_AFTER=(\d+)$", script, re.M).group(1))
    assert sum(int(s) for s in limits.values()) + kill_after * len(limits) <= 8 * 60
    ran = set(re.findall(r"^\s*run_step ([\w-]+) ", script, re.M)) | set(
        re.findall(r'not_run "?([\w-]+)"? "', script)
    )
    assert ran == set(limits), "every step has a limit, and every limit a step"
    assert set(limits) == {"setup", "kernel-tests", "e2e", "serve", "throughput"}


def test_a_made_bundle_holds_the_list_under_its_limit():
    made = REPO_ROOT / ".gpu-bundle"
    if not (made / "wheels").is_dir():
        pytest.skip("no .gpu-bundle here (make gpu-bundle needs PyPI); the list is checked above")
    wheels = {bundle.wheel_distribution(p.name) for p in (made / "wheels").glob("*.whl")}
    assert {bundle.normalized(n) for n in bundle.BUNDLE} <= wheels
    assert (made / "models" / bundle.DEFAULT_MODEL_HF / "tokenizer.json").exists()
    assert sum(p.stat().st_size for p in made.rglob("*") if p.is_file()) < bundle.LIMIT_BYTES
