"""Structured outputs: what a constrained request's text must match.

A request sets exactly one kind of constraint. The engine core compiles it
into a grammar over the model's vocabulary and masks every token the
grammar forbids before sampling, so the output can only be text the
constraint accepts.

A JSON schema given as a dict is stored as its JSON text: the wire carries
one type, and the text doubles as the compiled-grammar cache key.
"""

from __future__ import annotations

import json as _json
from typing import Any

import msgspec

# The kinds, in the order a request's fields are checked.
KINDS = ("choice", "regex", "json", "json_object", "grammar")

# Upper bounds (seconds) of the grammar compile-time histogram buckets; the
# engine counts into them and the API exposes them, so both read this list.
COMPILE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True):
    """One of ``choice``, ``regex``, ``json`` (a JSON Schema), ``json_object``
    (any JSON object) or ``grammar`` (EBNF with ``root ::=``, or Lark with
    ``start:``). ``disable_any_whitespace`` makes JSON compact.

    A map on the wire (not ``array_like``): fields may be added anywhere,
    with defaults.
    """

    choice: list[str] | None = None
    regex: str | None = None
    json: str | dict[str, Any] | None = None
    json_object: bool = False
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if _is_set(getattr(self, k))]
        if len(set_kinds) != 1:
            given = ", ".join(set_kinds) if set_kinds else "none"
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; got {given}.")
        if self.json is not None:
            self.json = _schema_text(self.json)
        self._validate_kind(set_kinds[0])

    def _validate_kind(self, kind: str) -> None:
        if kind == "choice":
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(
                    f"choice must be a non-empty list of non-empty strings, got {self.choice!r}."
                )
        elif kind in ("regex", "grammar") and not getattr(self, kind).strip():
            raise ValueError(f"{kind} must be a non-empty string.")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``KINDS``."""
        return next(k for k in KINDS if _is_set(getattr(self, k)))

    @property
    def spec(self) -> str:
        """The constraint as text (choices as a JSON list)."""
        kind = self.kind
        if kind == "choice":
            return _json.dumps(self.choice)
        if kind == "json_object":
            return ""
        text: str = getattr(self, kind)  # regex, grammar, or json (text since __post_init__)
        return text

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        """Requests with equal keys share one compiled grammar."""
        whitespace = self.disable_any_whitespace and self.kind in ("json", "json_object")
        return self.kind, self.spec, whitespace


def _is_set(value: object) -> bool:
    return value is not None and value is not False


def _schema_text(schema: str | dict[str, Any]) -> str:
    """A JSON schema as JSON text (a dict written compactly); ValueError if it is not JSON."""
    if isinstance(schema, str):
        try:
            parsed = _json.loads(schema)
        except ValueError as e:
            raise ValueError(f"json must be a JSON schema; its text is not valid JSON: {e}.") from None
        if not isinstance(parsed, (dict, bool)):
            raise ValueError(
                f"json must be a JSON schema: an object (or true/false), got {type(parsed).__name__}."
            )
        return schema
    return _json.dumps(schema, separators=(",", ":"))


class StructuredOutputStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """An engine's structured-output totals since it started.

    Totals, not deltas, so a stats message resent as a heartbeat counts
    nothing twice. Field order is the wire contract: append only.
    """

    num_requests: int = 0  # constrained requests received
    # Compiles per COMPILE_TIME_BUCKETS bucket (not cumulative), the last
    # one for those slower than every bound.
    compile_counts: list[int] = []
    compile_seconds: float = 0.0  # summed over every compile
