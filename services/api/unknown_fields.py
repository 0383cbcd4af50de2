"""Request bodies with fields weft does not know: a 400 naming them, or a warning.

The request Structs forbid unknown fields, so msgspec stops at the first
one; only then is the body looked at again as a plain JSON object, to name
every unknown field at once (the body size is already capped). With
``--allow-unknown-fields`` the body is decoded by a twin Struct that
ignores them, and the names are logged.
"""

from __future__ import annotations

import functools
import logging
from typing import TypeVar, cast

import msgspec

from services.api.errors import bad_request, from_validation_error

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=msgspec.Struct)
_UNKNOWN = "Object contains unknown field"


def decode_request(body: bytes, type: type[T], allow_unknown: bool = False) -> T:
    """``body`` as ``type``; 400 on bad JSON, a bad shape or (unless ``allow_unknown``) unknown fields."""
    try:
        return msgspec.json.decode(body, type=type)
    except msgspec.ValidationError as e:
        if not _is_top_level_unknown(e):
            raise from_validation_error(e) from e
    except msgspec.DecodeError as e:
        raise from_validation_error(e) from e
    try:
        # msgspec stops at the first unknown key, perhaps before a syntax error further on.
        names = unknown_field_names(body, type)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise from_validation_error(e) from e
    if not allow_unknown:
        raise bad_request(
            f"Unknown field(s) in the request: {', '.join(names)}. "
            f"(The server accepts them only with --allow-unknown-fields.)",
            names[0],
        )
    logger.warning("Ignoring unknown request field(s) of %s: %s", type.__name__, ", ".join(names))
    try:
        return msgspec.json.decode(body, type=_lenient(type))
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise from_validation_error(e) from e


def unknown_field_names(body: bytes, type: type[msgspec.Struct]) -> list[str]:
    """The top-level keys of ``body`` that ``type`` does not declare, in body order."""
    known = {f.encode_name for f in msgspec.structs.fields(type)}
    return [key for key in msgspec.json.decode(body, type=dict) if key not in known]


def _is_top_level_unknown(e: msgspec.ValidationError) -> bool:
    message = str(e)
    return message.startswith(_UNKNOWN) and "at `$." not in message


def _lenient(struct: type[T]) -> type[T]:
    """A subclass of ``struct`` that ignores unknown fields (same fields, same behaviour)."""
    return cast("type[T]", _lenient_subclass(struct))  # a subclass of ``struct``: its only base


@functools.cache
def _lenient_subclass(struct: type[msgspec.Struct]) -> type[msgspec.Struct]:
    return msgspec.defstruct(
        f"Lenient{struct.__name__}", [], bases=(struct,), forbid_unknown_fields=False, kw_only=True
    )
