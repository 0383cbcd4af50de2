"""``speculative_config`` as users give it (a dict, or JSON on the command line),
resolved into the frozen ``SpeculativeConfig``.

Torch-free: the API process builds the engine config too.
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol import SpeculativeConfig
from services.config.json_arg import parse_json_object

# vLLM's default when neither prompt_lookup bound is given.
_DEFAULT_LOOKUP = 5


def resolve_speculative_config(value: dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """None (or an empty value) turns speculation off; otherwise a validated config.

    Like vLLM: when only one of ``prompt_lookup_min`` / ``prompt_lookup_max``
    is given the other copies it, and when neither is, both are 5.
    """
    value = parse_json_object(value, "speculative_config")
    if value is None:
        return None
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config needs num_speculative_tokens (the draft length K).")
    low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    value["prompt_lookup_min"] = low if low is not None else high if high is not None else _DEFAULT_LOOKUP
    value["prompt_lookup_max"] = high if high is not None else value["prompt_lookup_min"]
    try:
        return msgspec.convert(value, SpeculativeConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"speculative_config is not valid: {e}.") from e
