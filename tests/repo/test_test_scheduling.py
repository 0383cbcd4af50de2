"""``make test`` runs on both cores (pytest-xdist), one module per worker, the longest first.

The Makefile's test targets all go through ``$(PYTEST)``; tests/scheduling.py keeps a module's
tests (and the modules sharing ``default_server``) on one worker and orders the groups.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

from tests.scheduling import group_of, run_order
from tests.utils import REPO_ROOT

MAKEFILE = (REPO_ROOT / "Makefile").read_text()


def _recipe(target: str) -> str:
    return re.search(rf"^{re.escape(target)}:.*\n\t(.+)$", MAKEFILE, re.M)[1]


def test_every_test_target_runs_on_two_workers_grouped_as_scheduling_says():
    assert re.search(r"^PYTEST_WORKERS \?= 2$", MAKEFILE, re.M)
    pytest_line = re.search(r"^PYTEST = (.+)$", MAKEFILE, re.M)[1]
    assert "-m pytest" in pytest_line and "-n $(PYTEST_WORKERS)" in pytest_line
    # loadgroup: the xdist_group marks decide; no reorder: the collection's order (the longest first).
    assert "--dist loadgroup" in pytest_line and "--no-loadscope-reorder" in pytest_line
    assert _recipe("test") == "$(PYTEST)"
    assert _recipe("test-fast") == '$(PYTEST) -m "not slow"'
    assert _recipe("test-slow") == "$(PYTEST) -m slow"


def test_pytest_xdist_is_a_test_requirement_pinned_in_the_dev_lock():
    lock = (REPO_ROOT / "requirements-dev.lock").read_text().splitlines()
    assert any(re.fullmatch(r"pytest-xdist==[\d.]+", line) for line in lock)
    assert any(re.fullmatch(r"execnet==[\d.]+", line) for line in lock)  # xdist's own requirement
    assert '"pytest-xdist"' in (REPO_ROOT / "pyproject.toml").read_text()


def _item(nodeid: str, *fixtures: str) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, fixturenames=["request", *fixtures])


def test_a_module_is_one_group_and_default_servers_users_share_one():
    assert group_of(_item("tests/test_llm.py::test_a[x]")) == group_of(_item("tests/test_llm.py::test_b"))
    assert group_of(_item("tests/test_llm.py::test_a")) == "tests/test_llm.py"
    assert group_of(_item("tests/test_a.py::t", "default_server")) == "default_server"
    assert group_of(_item("tests/api/test_b.py::C::t", "default_server")) == "default_server"


def test_groups_go_out_new_first_then_slow_then_longest():
    new_slow, new_fast = run_order(True, None), run_order(False, None)
    known_long, known_short, known_slow = run_order(False, 90.0), run_order(False, 1.0), run_order(True, 5.0)
    order = sorted([known_short, new_fast, known_long, known_slow, new_slow])
    assert order == [new_slow, new_fast, known_long, known_slow, known_short]
