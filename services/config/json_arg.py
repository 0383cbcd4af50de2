"""JSON-object engine arguments (``--speculative-config '<json>'`` and the like)."""

from __future__ import annotations

import json
from typing import Any


def parse_json_object(value: dict[str, Any] | str | None, name: str) -> dict[str, Any] | None:
    """A dict from a dict or JSON text; None for an empty value (the feature is off)."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON ({e}): {value!r}.") from e
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object (a dict), got {value!r}.")
    return dict(value)
