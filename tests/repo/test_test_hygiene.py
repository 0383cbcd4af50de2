"""The tests' own rules, read from their source: tiers and waiting.

A test that starts an engine, a server or a stack (or loads the real model)
is ``slow``, and its module says so (``pytestmark = pytest.mark.slow``, or
``@pytest.mark.slow`` on the test): ``make test-fast`` leaves it out. A test
that waits on another process does it through tests/polling.py, never with a
deadline loop of its own.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from tests.utils import REPO_ROOT

TESTS = REPO_ROOT / "tests"

# What starts a process or loads the real model, called by name: the engine in this
# process, its executors and engine-core loop, the stacks of servers, the model loaders.
STARTERS = frozenset(
    {
        "LLM",
        "Stack",
        "PDStack",
        "EngineCoreProc",
        "MultiprocExecutor",
        "launch_local_engines",
        "load_hf_model",
    }
)
# Modules a test runs as a process (``python -m ...``) that are engines or servers.
PROCESS_MODULES = frozenset({"services.cli", "services.engine_core.proc", "services.engine_core.cli"})
# What ``subprocess.run`` of the CLI may do and return at once (anything else serves).
ONE_SHOT_WORDS = ("--help", "--version")
# Fixtures (conftest.py) that start a server or load the real model.
STARTING_FIXTURES = frozenset({"default_server", "hf_default_model", "smollm_runner"})


@functools.cache
def _parse(source: str) -> ast.Module:
    """One parse per file's text, for both checks."""
    return ast.parse(source)


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _direct_start(node: ast.AST, helpers: dict[str, ast.AST]) -> str | None:
    """What in ``node``'s own body starts a process or loads the real model, if anything
    (nothing where it stands a fake in for ``subprocess.Popen``). A command line may be
    built by one of the module's ``helpers``."""
    calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
    if any(_called_name(c) == "setattr" and "Popen" in _strings(c) for c in calls):
        return None
    words = set(_strings(node))
    for call in calls:
        if isinstance(call.func, ast.Name) and call.func.id in helpers:
            words |= set(_strings(helpers[call.func.id]))
    for call in calls:
        name = _called_name(call)
        if name in STARTERS:
            return f"{name}(...)"
        if name == "spawn" and "multiprocessing" in ast.unparse(call.func):
            return "multiprocessing.spawn(...)"
        served = words & PROCESS_MODULES
        if name == "Popen" and served:
            return f"Popen of {min(served)}"
        if (
            name == "run"
            and served
            and not words & set(ONE_SHOT_WORDS)
            and "subprocess" in ast.unparse(call.func)
        ):
            return f"subprocess.run of {min(served)}"
    return None


def _is_slow_mark(node: ast.AST) -> bool:
    return "pytest.mark.slow" in ast.unparse(node)


def _module_marked_slow(tree: ast.Module) -> bool:
    return any(
        isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)
        and _is_slow_mark(n.value)
        for n in tree.body
    )


def unmarked_starters(path: Path) -> list[str]:
    """The tests of ``path`` that start a process (themselves, through a helper or a fixture)
    and are not marked slow, each with what it starts."""
    tree = _parse(path.read_text())
    if _module_marked_slow(tree):
        return []
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    tests: list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, bool]] = [
        (f, any(_is_slow_mark(d) for d in f.decorator_list)) for f in functions.values()
    ]
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        class_slow = any(_is_slow_mark(d) for d in cls.decorator_list)
        tests += [
            (f, class_slow or any(_is_slow_mark(d) for d in f.decorator_list))
            for f in cls.body
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        ]

    @functools.cache
    def starts(name: str, seen: frozenset[str] = frozenset()) -> str | None:
        node = functions[name]
        if reason := _direct_start(node, functions):
            return reason
        names = [n for n in ast.walk(node) if isinstance(n, ast.Name)]
        local = {n.id for n in names if isinstance(n.ctx, ast.Store)}
        used = {n.id for n in names if isinstance(n.ctx, ast.Load)} - local
        used |= {a.arg for a in node.args.args}  # fixtures by parameter name
        if starting := used & STARTING_FIXTURES:
            return f"the {min(starting)} fixture"
        for other in sorted(used & functions.keys() - seen - {name}):
            if reason := starts(other, seen | {name}):
                return f"{other}: {reason}"
        return None

    found = []
    for test, slow in tests:
        if not test.name.startswith("test") or slow:
            continue
        if (reason := starts(test.name)) if test.name in functions else _direct_start(test, functions):
            where = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path.name
            found.append(f"{where}::{test.name} ({reason})")
    return found


def test_every_test_that_starts_an_engine_a_server_or_a_stack_is_marked_slow() -> None:
    unmarked = [t for path in sorted(TESTS.rglob("test_*.py")) for t in unmarked_starters(path)]
    assert not unmarked, (
        "these tests start processes or load the real model but run in `make test-fast`; "
        f"mark their module `pytestmark = pytest.mark.slow` (or the test @pytest.mark.slow): {unmarked}"
    )


def test_the_check_sees_a_starter_through_a_helper_and_a_fixture(tmp_path: Path) -> None:
    module = tmp_path / "test_example.py"
    module.write_text(
        "import subprocess, sys\n"
        "import pytest\n"
        "def serve():\n"
        "    return subprocess.Popen([sys.executable, '-m', 'services.cli', 'serve'])\n"
        "@pytest.fixture\n"
        "def server():\n"
        "    yield serve()\n"
        "def test_through_a_fixture(server):\n"
        "    pass\n"
        "def test_on_the_shared_server(default_server):\n"
        "    pass\n"
        "@pytest.mark.slow\n"
        "def test_marked(server):\n"
        "    pass\n"
        "def test_help():\n"
        "    subprocess.run([sys.executable, '-m', 'services.cli', '--help'])\n"
        "def test_a_sleeper():\n"
        "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(9)'])\n"
    )
    found = unmarked_starters(module)
    assert [f.split("::")[1].split(" ")[0] for f in found] == [
        "test_through_a_fixture",
        "test_on_the_shared_server",
    ]
    module.write_text("import pytest\npytestmark = [pytest.mark.slow]\n" + module.read_text())
    assert unmarked_starters(module) == []


CLOCKS = frozenset({"monotonic", "time", "perf_counter", "monotonic_ns", "time_ns"})


def deadline_loops(path: Path) -> list[str]:
    """The ``while`` loops of ``path`` that keep a deadline of their own: a clock read, or a
    name holding a deadline, compared in the loop's condition or its body."""

    def keeps_time(node: ast.AST) -> bool:
        for n in ast.walk(node):
            if isinstance(n, ast.Call) and _called_name(n) in CLOCKS and "time" in ast.unparse(n.func):
                return True
            if isinstance(n, ast.Name) and "deadline" in n.id.lower():
                return True
        return False

    found = []
    for loop in (n for n in ast.walk(_parse(path.read_text())) if isinstance(n, ast.While)):
        compares = [n for n in ast.walk(loop) if isinstance(n, ast.Compare)]
        if keeps_time(loop.test) or any(keeps_time(c) for c in compares):
            where = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path.name
            found.append(f"{where}:{loop.lineno}")
    return found


def test_tests_wait_through_polling_not_deadline_loops_of_their_own() -> None:
    loops = [
        loop
        for path in sorted(TESTS.rglob("*.py"))
        if path != TESTS / "polling.py"
        for loop in deadline_loops(path)
    ]
    assert not loops, f"wait with tests/polling.py (wait_for, wait_until, keep_for) instead: {loops}"


def test_the_check_sees_both_shapes_of_deadline_loop(tmp_path: Path) -> None:
    module = tmp_path / "test_example.py"
    module.write_text(
        "import time\n"
        "def a(ready):\n"
        "    deadline = time.monotonic() + 5\n"
        "    while time.monotonic() < deadline:\n"
        "        if ready():\n"
        "            return\n"
        "def b(ready):\n"
        "    end = time.time() + 5\n"
        "    while not ready():\n"
        "        assert time.time() < end\n"
        "def c(queue):\n"
        "    while queue:\n"
        "        queue.pop()\n"
    )
    assert deadline_loops(module) == ["test_example.py:4", "test_example.py:9"]
