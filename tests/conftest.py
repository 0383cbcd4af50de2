"""Shared fixtures: the default model's files, and a guard against KV leaks."""
from __future__ import annotations

from pathlib import Path

import pytest

from services import model_files

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def default_model() -> model_files.ModelFiles:
    return model_files.resolve(None)


@pytest.fixture(scope="session")
def workloads_dir() -> Path:
    return REPO_ROOT / "benchmarks" / "workloads"
