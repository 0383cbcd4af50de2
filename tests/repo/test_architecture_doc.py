"""docs/architecture.md names only code that exists."""

from __future__ import annotations

import re

from tests.utils import REPO_ROOT

DOC = REPO_ROOT / "docs" / "architecture.md"
# Paths in backquotes that start at a top-level folder of the repository.
PATH = re.compile(r"`((?:protocol|services|kernels|tests|benchmarks|docs)/[\w./-]*)`")
ENTRY_POINT = re.compile(r"`((?:services)/[\w/]+\.py)` `(\w+)\(")


def named_paths(text: str) -> set[str]:
    return set(PATH.findall(text))


def test_every_path_the_document_names_exists() -> None:
    paths = named_paths(DOC.read_text())
    assert len(paths) > 40  # the pattern still finds them
    missing = sorted(p for p in paths if not (REPO_ROOT / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_entry_point_it_lists_is_defined_there() -> None:
    entries = ENTRY_POINT.findall(DOC.read_text())
    assert len(entries) >= 6
    for path, function in entries:
        source = (REPO_ROOT / path).read_text()
        assert re.search(rf"^def {function}\(", source, re.M), f"{path} has no top-level {function}()"


def test_the_path_pattern_reads_backquoted_paths() -> None:
    text = "see `services/api/app.py` and `protocol/`, not services/x.py or `weft serve`"
    assert named_paths(text) == {"services/api/app.py", "protocol/"}
