"""services/env.py: every environment variable the code reads is declared there, and read only there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from services import env
from tests.utils import REPO_ROOT

PRODUCT = ("protocol", "services", "kernels")
ENV_PY = REPO_ROOT / "services" / "env.py"
# Files that still touch os.environ themselves, each being moved to services/env.py by other work;
# empty it as they land.
PENDING: tuple[str, ...] = ()
OS_ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
ENV_FUNCTIONS = {"get", "get_raw", "is_set", "put"}
WEFT_NAME = re.compile(r"\bWEFT_[A-Z0-9_]*[A-Z0-9]\b")


def product_files() -> list[Path]:
    return sorted(path for package in PRODUCT for path in (REPO_ROOT / package).rglob("*.py"))


def pending(path: Path) -> bool:
    relative = path.relative_to(REPO_ROOT).as_posix()
    return any(relative == p or (p.endswith("/") and relative.startswith(p)) for p in PENDING)


def environment_uses(tree: ast.AST) -> list[int]:
    """Lines that touch the process environment: ``os.environ`` (read, written or copied),
    ``os.getenv`` and the like, or any of them imported from ``os`` by name."""
    lines = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in OS_ENV_NAMES
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(alias.name in OS_ENV_NAMES for alias in node.names):
                lines.append(node.lineno)
    return sorted(lines)


def env_module_reads(tree: ast.AST) -> list[tuple[int, str | None]]:
    """``env.get(NAME)`` and its siblings: (line, the name read) with a literal or a module
    constant resolved to its string; None where the name is computed (a parameter)."""
    constants = {
        target.id: node.value.value
        for node in getattr(tree, "body", [])
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    reads = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ENV_FUNCTIONS
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "env"
            and node.args
        ):
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            reads.append((node.lineno, arg.value))
        elif isinstance(arg, ast.Name):
            reads.append((node.lineno, constants.get(arg.id)))
        else:
            reads.append((node.lineno, None))
    return reads


def test_only_env_py_touches_the_environment() -> None:
    found = []
    for path in product_files():
        if path == ENV_PY or pending(path):
            continue
        for line in environment_uses(ast.parse(path.read_text())):
            found.append(f"{path.relative_to(REPO_ROOT)}:{line}")
    assert not found, f"read or set the environment through services.env instead: {found}"


def test_the_check_sees_every_form_of_read() -> None:
    source = (
        "import os\nfrom os import environ as e\n"
        "a = os.environ.get(NAME)\nb = os.getenv('WEFT_X2')\nc = os.environ['WEFT_Y']\n"
        "d = 'HOME' in os.environ\nos.environ['Z'] = '1'\n"
    )
    assert environment_uses(ast.parse(source)) == [2, 3, 4, 5, 6, 7]
    reads = env_module_reads(
        ast.parse("K = 'WEFT_A1'\nx = env.get(K)\ny = env.get_raw('PATH', '')\nz = env.get(k)\n")
    )
    assert reads == [(2, "WEFT_A1"), (3, "PATH"), (4, None)]
    assert WEFT_NAME.findall("ENV = 'WEFT_AVX2_INT8'  # WEFT_QUANT_ISA, not WEFT_") == [
        "WEFT_AVX2_INT8",
        "WEFT_QUANT_ISA",
    ]


def test_every_name_the_code_reads_or_names_is_declared() -> None:
    declared = {variable.name for variable in (*env.VARIABLES, *env.PLATFORM)}
    undeclared = set()
    for path in product_files():
        text = path.read_text()
        undeclared |= set(WEFT_NAME.findall(text)) - declared
        for line, name in env_module_reads(ast.parse(text)):
            if name is not None and name not in declared:
                undeclared.add(f"{name} ({path.relative_to(REPO_ROOT)}:{line})")
    assert not undeclared, f"declare in services/env.py: {sorted(undeclared)}"


def test_env_py_imports_only_the_standard_library() -> None:
    tree = ast.parse(ENV_PY.read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "os", "dataclasses"}


def test_get_reads_declared_names_and_refuses_others(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEFT_PORT", "9000")
    assert env.get("WEFT_PORT") == "9000"
    monkeypatch.setenv("WEFT_PORT", "")
    assert env.get("WEFT_PORT", "8000") == "8000"  # empty is unset
    assert env.get_raw("WEFT_PORT", "8000") == "" and env.is_set("WEFT_PORT")
    monkeypatch.delenv("WEFT_PORT")
    assert env.get_raw("WEFT_PORT", "8000") == "8000" and not env.is_set("WEFT_PORT")
    with pytest.raises(KeyError, match="not declared"):
        env.get("WEFT_NO_SUCH_THING")
    with pytest.raises(KeyError, match="not declared"):
        env.put("WEFT_NO_SUCH_THING", "1")


def test_flag_overrides_are_those_the_parser_knows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEFT_PORT", "9000")
    monkeypatch.setenv("WEFT_HOST", "0.0.0.0")
    assert [(v.flag, value) for v, value in env.flag_overrides({"--port"})] == [("--port", "9000")]
    assert "WEFT_API_KEY" in env.describe()


def test_each_variable_is_declared_once() -> None:
    names = [variable.name for variable in (*env.VARIABLES, *env.PLATFORM)]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
