"""``weft bench``: every benchmark is a subcommand of the one package (benchmarks/bench/)."""

from __future__ import annotations

import pytest

from benchmarks.bench import cli

ALL = (
    "throughput",
    "latency",
    "compare",
    "serve",
    "executor",
    "pd",
    "gpu",
    "make-workload",
    "make-model",
    "soak",
)


def test_the_help_lists_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ALL)


@pytest.mark.parametrize(
    ("name", "usage"),
    [
        ("soak", "usage: weft bench soak"),
        ("pd", "usage: weft bench pd"),
        ("gpu", "usage: weft bench gpu"),
    ],
)
def test_each_benchmark_answers_its_own_help(
    name: str, usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([name, "--help"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith(usage)


def test_an_unknown_benchmark_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["nope"])
    assert exit_info.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err
