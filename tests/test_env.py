"""services/env.py: every WEFT_* variable the code reads is declared there, and only there."""

from __future__ import annotations

import re

import pytest

from services import env
from tests.utils import REPO_ROOT

PRODUCT = ("protocol", "services", "kernels")
# A read: .get("WEFT_..."), getenv("WEFT_..."), or ["WEFT_..."] not being assigned to (setting
# one for a child process, as the GPU bench does, is not a read).
READ = re.compile(
    r"""os\.(environ\.get|getenv)\(\s*["']WEFT_|os\.environ\[\s*["']WEFT_\w+["']\s*\](?!\s*=)"""
)


def test_only_env_py_reads_the_environment_for_weft_variables() -> None:
    readers = []
    for package in PRODUCT:
        for path in (REPO_ROOT / package).rglob("*.py"):
            if path == REPO_ROOT / "services" / "env.py":
                continue
            text = path.read_text()
            if READ.search(text):
                readers.append(str(path.relative_to(REPO_ROOT)))
    assert not readers, f"read WEFT_* through services.env.get instead: {readers}"


def test_every_weft_name_in_the_code_is_declared() -> None:
    declared = {variable.name for variable in env.VARIABLES}
    used = set()
    for package in PRODUCT:
        for path in (REPO_ROOT / package).rglob("*.py"):
            used |= set(re.findall(r"\bWEFT_[A-Z_]+\b", path.read_text()))
    assert used <= declared, f"undeclared: {sorted(used - declared)}"


def test_get_reads_declared_names_and_refuses_others(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEFT_PORT", "9000")
    assert env.get("WEFT_PORT") == "9000"
    monkeypatch.setenv("WEFT_PORT", "")
    assert env.get("WEFT_PORT", "8000") == "8000"  # empty is unset
    with pytest.raises(KeyError, match="not declared"):
        env.get("WEFT_NO_SUCH_THING")


def test_flag_overrides_are_those_the_parser_knows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEFT_PORT", "9000")
    monkeypatch.setenv("WEFT_HOST", "0.0.0.0")
    assert [(v.flag, value) for v, value in env.flag_overrides({"--port"})] == [("--port", "9000")]
    assert "WEFT_API_KEY" in env.describe()
