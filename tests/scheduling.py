"""How the tests share the machine's cores under pytest-xdist (``make test``: ``-n 2 --dist loadfile``).

- **A module is one unit.** ``--dist loadfile`` sends a module's tests to one worker, so its
  fixtures (its own server, engine, stack or loaded model) start once. The modules that share the
  session's ``default_server`` are one unit too (``SharedServerScheduling``), so that server starts
  once: they are listed in ``DEFAULT_SERVER_MODULES``, and a worker refuses to run when a module
  that uses the fixture is missing from the list. (xdist's own ``loadgroup`` cannot do it here: it
  renames node ids through an attribute pytest 9 no longer reads.)
- **The longest units first.** The units go to the workers in collection order
  (``--no-loadscope-reorder``), which this plugin sorts by each unit's seconds in the last
  parallel run (kept in pytest's cache; a unit with none, as in a fresh clone, goes first, the
  slow tier's before the rest): a long module started last would leave the other core idle
  while it runs.
- **One torch thread per worker, and per engine it starts.** Two workers each running torch on
  every core would run four threads on two; a test that is about threads sets its own count. A
  worker sets ``OMP_NUM_THREADS=1`` too, which the engines a test starts (in the worker, or as
  servers) take as their default ``--num-threads`` where the test gives none: beside a busy core,
  an engine of two threads waits at every op for whichever of them is descheduled (Gemma 3's
  small steps took 5x the CPU time on two threads; test_batch_invariance.py's batches 1.2x).
"""

from __future__ import annotations

import os

import pytest
from xdist.scheduler import LoadFileScheduling

SECONDS_KEY = "weft/xdist-unit-seconds"
# The modules that send requests to the session's one `weft serve` (tests/conftest.py).
DEFAULT_SERVER_MODULES = frozenset(
    {
        "tests/test_tool_calling_serve.py",
        "tests/test_embeddings_e2e.py",
        "tests/api/test_structured_api.py",
        "tests/test_api_params_e2e.py",
    }
)
DEFAULT_SERVER_UNIT = "default_server"


def unit_of(nodeid: str) -> str:
    """The unit of work (the module, or the modules sharing ``default_server``) a test belongs to."""
    module = nodeid.split("::", 1)[0]
    return DEFAULT_SERVER_UNIT if module in DEFAULT_SERVER_MODULES else module


class SharedServerScheduling(LoadFileScheduling):
    """xdist's ``loadfile``, with the modules of ``DEFAULT_SERVER_MODULES`` as one file."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown to pytest under -p no:xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log) -> SharedServerScheduling | None:
    return SharedServerScheduling(config, log) if config.getvalue("dist") == "loadfile" else None


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and workerinput["workercount"] > 1:
        import torch

        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"  # the engines' default (services/config/engine_args.py)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # only an xdist worker collects for the scheduler
        return
    unlisted = {
        item.nodeid.split("::", 1)[0]
        for item in items
        if "default_server" in getattr(item, "fixturenames", ())
        and unit_of(item.nodeid) != DEFAULT_SERVER_UNIT
    }
    if unlisted:
        raise pytest.UsageError(f"add {sorted(unlisted)} to tests/scheduling.py DEFAULT_SERVER_MODULES")
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    seconds: dict[str, float] = cache.get(SECONDS_KEY, {}) if cache is not None else {}
    units = [unit_of(item.nodeid) for item in items]
    slow = {unit for unit, item in zip(units, items, strict=True) if item.get_closest_marker("slow")}
    first: dict[str, int] = {}  # where each unit begins
    for i, unit in enumerate(units):
        first.setdefault(unit, i)
    key = {unit: (*run_order(unit in slow, seconds.get(unit)), first[unit]) for unit in units}
    order = sorted(range(len(items)), key=lambda i: key[units[i]])  # a unit stays whole
    items[:] = [items[i] for i in order]


def run_order(slow: bool, seconds: float | None) -> tuple[int, float]:
    """A unit's sort key: units with no figure yet first (a new module may be long), the slow
    tier's of them before the rest; then the others, the longest first."""
    return (0 if slow else 1, 0.0) if seconds is None else (2, -seconds)


class UnitSeconds:
    """On the controller: each unit's seconds (set-up, call and tear-down of its tests), saved
    at the end of a parallel run for the next one's order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        unit = unit_of(report.nodeid)
        self.seconds[unit] = self.seconds.get(unit, 0.0) + report.duration

    def save(self, config: pytest.Config) -> None:
        cache = getattr(config, "cache", None)
        if cache is None or not self.seconds:
            return
        merged = {**cache.get(SECONDS_KEY, {}), **{u: round(s, 2) for u, s in self.seconds.items()}}
        cache.set(SECONDS_KEY, merged)


def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        config.pluginmanager.register(UnitSeconds(), "weft-unit-seconds")


def pytest_sessionfinish(session: pytest.Session) -> None:
    recorder = session.config.pluginmanager.get_plugin("weft-unit-seconds")
    if isinstance(recorder, UnitSeconds):
        recorder.save(session.config)
