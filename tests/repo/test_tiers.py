"""The test tiers' list names tests that exist."""

from __future__ import annotations

import re

from tests.conftest import SLOW
from tests.utils import REPO_ROOT


def test_everything_the_slow_list_names_exists() -> None:
    missing = []
    for entry in sorted(SLOW):
        module, _, test = entry.partition("::")
        path = REPO_ROOT / module
        if not path.is_file() or (test and not re.search(rf"^(async )?def {test}\(", path.read_text(), re.M)):
            missing.append(entry)
    assert not missing, f"SLOW in tests/conftest.py names tests that do not exist: {missing}"
