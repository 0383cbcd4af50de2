"""How the tests share the machine's cores under pytest-xdist (``make test``: ``-n 2 --dist loadgroup``).

- **One worker per module.** Every test gets an ``xdist_group`` mark naming its module, so a
  module's fixtures (its own server, engine or stack) start once, on the worker that runs the
  module. The modules that share the session's ``default_server`` form one group, so that server
  starts once too.
- **The longest groups first.** The groups go to the workers in collection order
  (``--no-loadscope-reorder``), which this plugin sorts by each group's seconds in the last
  parallel run (kept in pytest's cache; a group with none, as in a fresh clone, goes first, the
  slow tier's before the rest): a long module started last would leave the other core idle
  while it runs.
- **One torch thread per worker.** Two workers each running torch on every core would run four
  threads on two; a test that is about threads sets its own count. Engines that tests start take
  ``--num-threads`` / ``num_threads`` from the test.
"""

from __future__ import annotations

import pytest

SECONDS_KEY = "weft/xdist-group-seconds"
SHARED_FIXTURE_GROUPS = ("default_server",)  # session fixtures that start a server: one group each


def group_of(item: pytest.Item) -> str:
    shared = [name for name in SHARED_FIXTURE_GROUPS if name in getattr(item, "fixturenames", ())]
    return shared[0] if shared else item.nodeid.split("::")[0]


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and workerinput["workercount"] > 1:
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # only an xdist worker collects for the scheduler
        return
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    seconds: dict[str, float] = cache.get(SECONDS_KEY, {}) if cache is not None else {}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group_of(item)))
    groups = [group_of(item) for item in items]
    slow = {group for group, item in zip(groups, items, strict=True) if item.get_closest_marker("slow")}
    first: dict[str, int] = {}  # where each group begins
    for i, group in enumerate(groups):
        first.setdefault(group, i)
    key = {group: (*run_order(group in slow, seconds.get(group)), first[group]) for group in groups}
    order = sorted(range(len(items)), key=lambda i: key[groups[i]])  # a group stays whole
    items[:] = [items[i] for i in order]


def run_order(slow: bool, seconds: float | None) -> tuple[int, float]:
    """A group's sort key: groups with no figure yet first (a new module may be long), the slow
    tier's of them before the rest; then the others, the longest first."""
    return (0 if slow else 1, 0.0) if seconds is None else (2, -seconds)


class GroupSeconds:
    """On the controller: each group's seconds (set-up, call and tear-down of its tests), saved
    at the end of a parallel run for the next one's order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # xdist appends "@<group>" to the node id (an "@" inside a parameter's "[...]" is not one).
        nodeid = report.nodeid
        group = nodeid.rsplit("@", 1)[-1] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid.split("::")[0]
        self.seconds[group] = self.seconds.get(group, 0.0) + report.duration

    def save(self, config: pytest.Config) -> None:
        cache = getattr(config, "cache", None)
        if cache is None or not self.seconds:
            return
        merged = {**cache.get(SECONDS_KEY, {}), **{g: round(s, 2) for g, s in self.seconds.items()}}
        cache.set(SECONDS_KEY, merged)


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    parallel = config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None)
    if parallel and not hasattr(config, "workerinput"):
        config.pluginmanager.register(GroupSeconds(), "weft-group-seconds")


def pytest_sessionfinish(session: pytest.Session) -> None:
    recorder = session.config.pluginmanager.get_plugin("weft-group-seconds")
    if isinstance(recorder, GroupSeconds):
        recorder.save(session.config)
