"""The product packages, and the benchmarks beside them, import each other without a cycle.

Lazy imports (inside functions) and ``TYPE_CHECKING`` blocks count: a cycle
hidden behind a late import still ties the two modules' designs together.
The graph is read with ``ast``, so nothing is imported to build it.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("protocol", "services", "kernels")
# Outside the product, importing it (tests/repo/test_benchmarks_layout.py: never the other way).
PACKAGES = (*PRODUCT, "benchmarks")


def module_files(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Each module of ``packages`` by dotted name; files in folders that are not packages
    (``benchmarks/scripts/``, programs run by path) are left out."""
    modules = {}
    for package in packages:
        for path in (REPO_ROOT / package).rglob("*.py"):
            if not (path.parent / "__init__.py").is_file():
                continue
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(tree: ast.AST, package: str) -> set[str]:
    """Every dotted name an import anywhere in ``tree`` may refer to."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return names


def longest_known(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = {longest_known(n, modules) for n in imported_names(ast.parse(path.read_text()), package)}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None; iterative depth-first search."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            child = next(stack[-1], None)
            if child is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(child) == 1:
                return path[path.index(child) :] + [child]
            elif child not in state:
                state[child] = 1
                path.append(child)
                stack.append(iter(sorted(graph[child])))
    return None


def test_the_product_packages_have_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 100  # the walk found the packages
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_lazy_and_relative_imports() -> None:
    lazy = ast.parse("def f():\n    from services.api import serving\n")
    assert "services.api.serving" in imported_names(lazy, "services.api")
    relative = ast.parse("from .request import Request\n")
    assert "services.engine_core.request" in imported_names(relative, "services.engine_core")
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
