"""What a constrained request carries: its grammar, or the compile it waits on.

Its own module so that ``engine_core/request.py`` can name the type without
importing the manager, which imports ``Request``.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from protocol import StructuredOutputsParams
from services.engine_core.structured_output.backend import StructuredOutputGrammar


@dataclass
class CompileJob:
    submitted_at: float
    # Resolves to the backend's compiled grammar (an opaque object only its backend reads).
    future: Future[Any] = field(default_factory=Future)
    started_at: float | None = None  # set by the pool thread when compiling begins


@dataclass
class StructuredOutputRequest:
    """A constrained request's grammar: compiling until ``grammar`` is set."""

    params: StructuredOutputsParams
    job: CompileJob
    grammar: StructuredOutputGrammar | None = None
