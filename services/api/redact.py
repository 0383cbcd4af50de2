"""Keeping the server's insides out of what a client is told.

An engine's error message may carry what a library put there for its own
developers: xgrammar starts every error with a timestamp and the C++ source
file and line it came from, and a Python error may name a file on this
machine. The client needs what went wrong, not where the server keeps its files.
"""

from __future__ import annotations

import re

# "[08:40:20] /project/cpp/grammar_parser.cc:106: " (xgrammar's, TVM's prefix)
_SOURCE_PREFIX = re.compile(
    r"(?:\[\d{1,2}:\d{2}:\d{2}\]\s*)?(?:/[\w.+-]+)+\.(?:cc|cpp|cxx|c|h|hpp|py)"
    r":\d+:\s*"
)
# An absolute path of two parts or more, not inside a longer word or path.
_ABSOLUTE_PATH = re.compile(r"(?<![\w/.~-])/(?:[\w.+-]+/)+[\w.+-]+")


def redact(message: str) -> str:
    """``message`` without source locations and absolute paths."""
    return _ABSOLUTE_PATH.sub("<path>", _SOURCE_PREFIX.sub("", message)).strip()
