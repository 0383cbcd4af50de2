"""Structured outputs in the engine core: grammar compilation and token masks.

``StructuredOutputManager`` is what the scheduler talks to; backends
(xgrammar by default) sit behind ``backend.StructuredOutputBackend``.
"""

from services.engine_core.structured_output.manager import StructuredOutputManager
from services.engine_core.structured_output.request_state import StructuredOutputRequest

__all__ = ["StructuredOutputManager", "StructuredOutputRequest"]
