"""The repository needs nothing outside itself (``.ci/clone-check`` runs the
fast tier in a clone with nothing beside it; this is the cheap part of that)."""

from __future__ import annotations

import re
import subprocess

from tests.utils import REPO_ROOT

# A sibling folder of the checkout, as the development machines have one.
OUTSIDE = re.compile(r"\.\." + r"/shared|/work" + r"/shared")


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name]


def test_no_tracked_file_refers_to_a_folder_beside_the_repository() -> None:
    offenders = []
    for name in tracked_files():
        path = REPO_ROOT / name
        if path.is_symlink() or not path.is_file():
            continue
        text = path.read_bytes().decode(errors="ignore")
        offenders += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}" for m in OUTSIDE.finditer(text)]
    assert not offenders, f"refer to files outside the repository: {offenders}"


def test_the_pattern_finds_what_it_looks_for() -> None:
    assert OUTSIDE.search("see ../" + "shared/workloads") and not OUTSIDE.search("shared prefix")
