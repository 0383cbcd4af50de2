"""``make test`` runs on both cores (pytest-xdist), one module per worker, the longest first.

The Makefile's test targets all go through ``$(PYTEST)``; tests/scheduling.py keeps a module's
tests (and the modules sharing ``default_server``) on one worker and orders the units.
"""

from __future__ import annotations

import re

from tests.scheduling import DEFAULT_SERVER_MODULES, run_order, unit_of
from tests.utils import REPO_ROOT

MAKEFILE = (REPO_ROOT / "Makefile").read_text()


def _recipe(target: str) -> str:
    return re.search(rf"^{re.escape(target)}:.*\n\t(.+)$", MAKEFILE, re.M)[1]


def test_every_test_target_runs_on_two_workers_grouped_as_scheduling_says():
    assert re.search(r"^PYTEST_WORKERS \?= 2$", MAKEFILE, re.M)
    pytest_line = re.search(r"^PYTEST = (.+)$", MAKEFILE, re.M)[1]
    assert "-m pytest" in pytest_line and "-n $(PYTEST_WORKERS)" in pytest_line
    # loadfile: a module per worker (tests/scheduling.py's scheduler); no reorder: the collection's
    # order, which tests/scheduling.py sorts (the longest first).
    assert "--dist loadfile" in pytest_line and "--no-loadscope-reorder" in pytest_line
    assert _recipe("test") == "$(PYTEST)"
    assert _recipe("test-fast") == '$(PYTEST) -m "not slow"'
    assert _recipe("test-slow") == "$(PYTEST) -m slow"


def test_pytest_xdist_is_a_test_requirement_pinned_in_the_dev_lock():
    lock = (REPO_ROOT / "requirements-dev.lock").read_text().splitlines()
    assert any(re.fullmatch(r"pytest-xdist==[\d.]+", line) for line in lock)
    assert any(re.fullmatch(r"execnet==[\d.]+", line) for line in lock)  # xdist's own requirement
    assert '"pytest-xdist"' in (REPO_ROOT / "pyproject.toml").read_text()


def test_a_module_is_one_unit_and_default_servers_users_share_one():
    assert (
        unit_of("tests/test_llm.py::test_a[x::y]")
        == unit_of("tests/test_llm.py::test_b")
        == "tests/test_llm.py"
    )
    assert (
        unit_of("tests/api/test_x.py::Class::test") == "tests/api/test_x.py"
    )  # a class is not a unit of its own
    assert {unit_of(f"{module}::t") for module in DEFAULT_SERVER_MODULES} == {"default_server"}


def test_default_server_modules_lists_every_module_that_uses_it():
    """The worker checks it too (it refuses to run), but only for the tests it collected."""
    users = {
        path.relative_to(REPO_ROOT).as_posix()
        for path in (REPO_ROOT / "tests").rglob("test_*.py")
        if re.search(r"\bdefault_server\b", path.read_text()) and path.parent.name != "repo"
    }
    assert users == DEFAULT_SERVER_MODULES


def test_units_go_out_new_first_then_slow_then_longest():
    new_slow, new_fast = run_order(True, None), run_order(False, None)
    known_long, known_short, known_slow = run_order(False, 90.0), run_order(False, 1.0), run_order(True, 5.0)
    order = sorted([known_short, new_fast, known_long, known_slow, new_slow])
    assert order == [new_slow, new_fast, known_long, known_slow, known_short]
