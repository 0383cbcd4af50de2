"""The benchmarks stand apart from the product, and their index names each one.

The product (``protocol/``, ``services/``, ``kernels/``) never imports ``benchmarks``.

The benchmarks import the product, never the other way: the one door is the ``weft``
command's dispatcher, which imports ``benchmarks.bench`` inside the functions that run
``weft bench`` and list it in ``weft --help`` (``ALLOWED``). Read with ``ast``: a late
import inside any other function, a ``TYPE_CHECKING`` block or ``importlib.import_module``
with a literal name counts too. ``benchmarks/README.md`` lists every ``weft bench``
subcommand and every script in ``benchmarks/scripts/``, and every path it names exists.
"""

from __future__ import annotations

import ast
import re

from benchmarks.bench.cli import OWN_PARSERS, SUBCOMMANDS
from tests.repo.test_import_graph import PRODUCT, REPO_ROOT, module_files

# (file, function): where the product may import benchmarks.
ALLOWED = frozenset({("services/cli.py", "_bench"), ("services/cli.py", "_bench_lines")})


def _is_benchmarks(name: str) -> bool:
    return name == "benchmarks" or name.startswith("benchmarks.")


def benchmark_imports(tree: ast.AST) -> list[tuple[str | None, int]]:
    """(the innermost enclosing function's name or None, line) of each import of benchmarks."""
    found = []

    def visit(node: ast.AST, function: str | None) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("import_module", "__import__")):
            names = [
                a.value for a in node.args[:1] if isinstance(a, ast.Constant) and isinstance(a.value, str)
            ]
        if any(_is_benchmarks(name) for name in names):
            found.append((function, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, None)
    return found


def test_the_product_never_imports_the_benchmarks() -> None:
    modules = module_files(PRODUCT)
    assert len(modules) > 100  # the walk found the packages
    offenders = []
    for path in modules.values():
        where = str(path.relative_to(REPO_ROOT))
        for function, line in benchmark_imports(ast.parse(path.read_text())):
            if (where, function) not in ALLOWED:
                offenders.append(f"{where}:{line}")
    assert not offenders, f"the product imports benchmarks (only weft bench's dispatcher may): {offenders}"


def test_the_weft_command_imports_the_benchmarks_only_where_allowed() -> None:
    tree = ast.parse((REPO_ROOT / "services" / "cli.py").read_text())
    assert {function for function, _ in benchmark_imports(tree)} == {f for _, f in ALLOWED}


def test_the_scan_finds_late_typed_and_dynamic_imports() -> None:
    source = (
        "import benchmarks\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from benchmarks.stack import Stack\n"
        "def f():\n"
        "    from benchmarks.bench import cli\n"
        "async def g():\n"
        "    importlib.import_module('benchmarks.bench.peers')\n"
        "from services import benchmarks_like\n"
        "import benchmarksx\n"
    )
    assert benchmark_imports(ast.parse(source)) == [(None, 1), (None, 4), ("f", 6), ("g", 8)]


INDEX = REPO_ROOT / "benchmarks" / "README.md"


def test_the_index_lists_every_benchmark_command_and_script() -> None:
    text = INDEX.read_text()
    commands = [*SUBCOMMANDS, *OWN_PARSERS]
    assert [name for name in commands if f"| `weft bench {name}` |" not in text] == []
    scripts = sorted(
        p.name for p in (REPO_ROOT / "benchmarks" / "scripts").iterdir() if p.suffix in (".py", ".c")
    )
    assert len(scripts) > 10
    assert [name for name in scripts if f"`benchmarks/scripts/{name}`" not in text] == []


def test_every_path_the_index_names_exists() -> None:
    paths = re.findall(r"`(benchmarks/[\w./-]*)`", INDEX.read_text())
    assert len(paths) > 20
    assert [path for path in paths if not (REPO_ROOT / path).exists()] == []
