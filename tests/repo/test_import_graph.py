"""The product packages, and the benchmarks beside them, import each other without a cycle;
the product's packages import only downwards through their layers.

Lazy imports (inside functions) and ``TYPE_CHECKING`` blocks count: a cycle
hidden behind a late import still ties the two modules' designs together.
The graph is read with ``ast``, so nothing is imported to build it.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("protocol", "services", "kernels")
# Outside the product, importing it (tests/repo/test_benchmarks_layout.py: never the other way).
PACKAGES = (*PRODUCT, "benchmarks")


@functools.cache
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


@functools.cache  # read once for all the tests here; none changes it
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


# The folders in layers, lowest first: a module imports only from its own layer and those below
# it (docs/architecture.md, "Layers"). A module is in the layer of its longest listed prefix.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("env", ("services", "services.env")),  # the services package's __init__ is stdlib only too
    ("protocol", ("protocol",)),
    ("kernels", ("kernels",)),
    (
        "config",
        (
            "services.config",
            "services.config_file",
            "services.generation_config",
            "services.gguf_plain",
            "services.log_format",
            "services.model_files",
            "services.ports",
            "services.processes",
        ),
    ),
    ("kv_transfer", ("services.kv_transfer",)),
    ("worker", ("services.worker",)),
    ("engine_core", ("services.engine_core",)),
    ("api", ("services.api",)),
    (
        "entry points",
        (
            "services.cli",
            "services.llm",
            "benchmarks",  # outside the product; `weft bench` dispatches into it lazily
            "services.kv_transfer.proxy",  # the P/D proxy is an HTTP front of its own
            "services.kv_transfer.pd_up",
        ),
    ),
)


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of ``module``'s layer (``services`` alone is the package's __init__)."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or (prefix != "services" and module.startswith(prefix + "."))
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} ({LAYERS[layer_of(module)][0]}) -> {target} ({LAYERS[layer_of(target)][0]})"
        for module, targets in graph.items()
        for target in targets
        if layer_of(target) > layer_of(module)
    )


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    assert upward_imports(import_graph()) == []


def test_protocol_and_env_stand_alone() -> None:
    """protocol/ imports nothing from services/ or kernels/; services/env.py nothing of weft's
    (kernels/ reads its switches through it)."""
    graph = import_graph()
    protocol_out = {t for m, ts in graph.items() if m.split(".")[0] == "protocol" for t in ts}
    assert {t for t in protocol_out if t.split(".")[0] != "protocol"} == set()
    assert graph["services.env"] == set()
    assert graph["services"] <= {"services.env"}


def reachable(graph: dict[str, set[str]], roots: list[str]) -> set[str]:
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        module = stack.pop()
        if module not in seen:
            seen.add(module)
            stack.extend(graph[module])
    return seen


def test_the_api_reaches_neither_the_worker_nor_torch() -> None:
    """Every module the API process may import (lazy imports included) is outside services/worker
    and imports no torch or triton."""
    graph, modules = import_graph(), module_files()
    api = reachable(graph, [m for m in graph if m.startswith("services.api")])
    assert not [m for m in api if m.startswith("services.worker")]
    torch_users = []
    for module in sorted(api):
        path = modules[module]
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        names = imported_names(ast.parse(path.read_text()), package)
        torch_users += [f"{module}: {n}" for n in sorted(names) if n.split(".")[0] in ("torch", "triton")]
    assert torch_users == []


def test_the_layer_check_sees_an_upward_import() -> None:
    graph = {
        "services.config.engine_args": {"services.worker.models.registry"},
        "services.worker.worker": set(),
    }
    assert upward_imports(graph) == [
        "services.config.engine_args (config) -> services.worker.models.registry (worker)"
    ]
    assert upward_imports({"services.worker.worker": {"services.config.engine_args"}}) == []
    assert LAYERS[layer_of("services.kv_transfer.proxy")][0] == "entry points"
    assert LAYERS[layer_of("services.kv_transfer.trust")][0] == "kv_transfer"
