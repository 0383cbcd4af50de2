"""The constraint a completions or chat request asks for, checked at the door.

A request may ask through one of: OpenAI's ``response_format`` (json_object
or json_schema; ``text`` asks for nothing), vLLM's ``structured_outputs``
object, or the older ``guided_json`` / ``guided_regex`` / ``guided_choice``
/ ``guided_grammar`` fields. Asking through two is a 400, and so is a
constraint that fails the cheap syntax checks, before anything is
scheduled. A constraint that passes them but still fails to compile in the
engine fails that request alone, with the compiler's message.

``requested_fields`` names the fields that ask without building or checking
anything, so a conflict (forced tool calls plus a ``response_format``) is
found before either constraint is looked at in full.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from protocol import StructuredOutputsParams
from services.api.constraint_checks import check_grammar, check_json_schema, check_regex, check_size
from services.api.errors import bad_request
from services.api.openai_schemas import ResponseFormat, SamplingFields

# The legacy fields: body attribute -> StructuredOutputsParams field.
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_outputs_from(body: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint, or None; an APIError (400) naming the field
    if several fields ask for one or the one asked for is invalid."""
    asked = _requested(body)
    if len(asked) > 1:
        names = ", ".join(param for param, _ in asked)
        raise bad_request(
            f"Ask for structured output through one field only; this request sets {names}.", asked[1][0]
        )
    if not asked:
        return None
    param, build = asked[0]
    try:
        params = build()
        check_constraint(params)
    except ValueError as e:
        raise bad_request(f"Invalid {param}: {e}", param) from None
    return params


def check_constraint(params: StructuredOutputsParams) -> None:
    """The syntax checks of ``params``' kind of constraint; ValueError if it fails one."""
    kind = params.kind
    if kind == "regex":
        _named("regex", check_regex, params.regex)
    elif kind == "json":
        text = params.spec  # the schema as text (StructuredOutputsParams keeps it so)
        _named("JSON schema", check_size, text, "JSON schema")  # before parsing it again
        _named("JSON schema", check_json_schema, json.loads(text))
    elif kind == "grammar":
        _named("grammar", check_grammar, params.grammar)
    elif kind == "choice":  # compiled into a grammar: bounded like one
        _named("choice list", check_size, params.spec, "choice list")


def _named(what: str, check: Callable[..., None], *args: object) -> None:
    try:
        check(*args)
    except ValueError as e:
        raise ValueError(f"the {what} is not valid: {e}.") from None


def requested_fields(body: SamplingFields) -> list[str]:
    """The fields of ``body`` that ask for a constraint (nothing is built or checked)."""
    return [field for field, _ in _requested(body)]


_Builder = Callable[[], StructuredOutputsParams]


def _requested(body: SamplingFields) -> list[tuple[str, _Builder]]:
    """(field, a builder of its StructuredOutputsParams) for every field that asks."""
    asked: list[tuple[str, _Builder]] = []
    if (params := body.structured_outputs) is not None:
        asked.append(("structured_outputs", lambda: params))
    if (response_format := body.response_format) is not None and response_format.type != "text":
        asked.append(("response_format", lambda: _from_response_format(response_format)))
    for attr, field in _GUIDED.items():
        value = getattr(body, attr)
        if value is not None:
            asked.append((attr, _guided_builder(field, value)))
    return asked


def _guided_builder(field: str, value: Any) -> _Builder:
    return lambda: StructuredOutputsParams(**{field: value})


def _from_response_format(response_format: ResponseFormat) -> StructuredOutputsParams:
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = response_format.json_schema
    if spec is None or spec.schema is None:
        raise ValueError("type json_schema needs json_schema.schema, the JSON Schema to follow.")
    return StructuredOutputsParams(json=spec.schema)
