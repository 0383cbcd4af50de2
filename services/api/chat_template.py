"""Rendering a chat template the way transformers' ``apply_chat_template`` does.

The template is code from the model's files (or from ``--chat-template``),
run in jinja2's immutable sandbox with the settings and helpers transformers
gives it (``raise_exception``, ``strftime_now``, ``tojson`` with its
arguments, the ``{% generation %}`` tag), so a template written for
transformers renders the same text here.
"""

from __future__ import annotations

import codecs
import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from jinja2.exceptions import SecurityError
from jinja2.runtime import Context

# What transformers appends to the final message to find where it ends in the
# rendered text (``continue_final_message``): cut there, and the model goes on
# writing that message instead of starting a new turn.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# The names the renderer sets itself; a request's chat_template_kwargs may not replace them.
RESERVED_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"}
)
# A string with none of these is meant as a file path (vLLM's rule for --chat-template).
_JINJA_CHARS = "{}\n"
# The longest string or list ``*`` may make, and the most bits ``**`` may: a template's
# ``'a' * 1000000000`` or ``10 ** 10 ** 9`` is refused before it costs anything.
MAX_REPEAT_LENGTH = 1 << 20
MAX_POWER_BITS = 1 << 16


class ChatTemplateError(ValueError):
    """The template itself refused the messages (``raise_exception``): its message is the client's to read."""


class ContinueFinalMessageError(ValueError):
    """``continue_final_message`` cannot be done with these messages and this template."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the
    assistant's tokens with it; for rendering the block is just its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(str(message))


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters, which a prompt must not see.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, with ``*`` and ``**`` checked before they run."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            _check_repeat(left, right)
            _check_repeat(right, left)
        elif operator == "**":
            _check_power(left, right)
        return super().call_binop(context, operator, left, right)


def _check_repeat(sequence: Any, times: Any) -> None:
    if isinstance(sequence, (str, list, tuple, range)) and isinstance(times, int):
        if len(sequence) * times > MAX_REPEAT_LENGTH:
            raise SecurityError(
                f"a repetition of {len(sequence)} x {times} items, more than {MAX_REPEAT_LENGTH}"
            )


def _check_power(base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if abs(base).bit_length() * exponent > MAX_POWER_BITS:
            raise SecurityError(f"a power of more than {MAX_POWER_BITS} bits")


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached: the model's is compiled once, per-request ones a few at a time)."""
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    bos_token: str = "",
    eos_token: str = "",
    **kwargs: Any,
) -> str:
    """The prompt text; ``ChatTemplateError`` if the template refused,
    ``ContinueFinalMessageError`` if the final message cannot be continued,
    jinja2's errors if the template is broken."""
    if continue_final_message:
        messages = _tag_final_message(messages)
    text = compile_template(source).render(
        messages=messages,
        tools=tools,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        **kwargs,
    )
    return _cut_at_tag(text) if continue_final_message else text


def _tag_final_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not messages or not isinstance(messages[-1].get("content"), str):
        raise ContinueFinalMessageError(
            "continue_final_message needs a final message with text content to continue."
        )
    final = dict(messages[-1], content=messages[-1]["content"] + _CONTINUE_TAG)
    return [*messages[:-1], final]


def _cut_at_tag(text: str) -> str:
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise ContinueFinalMessageError(
            "continue_final_message is set, but this chat template does not "
            "show the final message's content, so there is nothing to continue."
        )
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


def load_chat_template(value: str) -> str:
    """``--chat-template``: a file's text, or the value itself when it is an
    inline template (it holds a brace or a newline); escapes like ``\\n`` in
    an inline one are read as what they stand for."""
    try:
        return Path(value).read_text()
    except OSError as e:
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(
                f"--chat-template {value!r} looks like a file path, but it cannot be read: {e.strerror}."
            ) from None
    return codecs.decode(value, "unicode_escape")


def check_template(source: str) -> None:
    """ValueError if ``source`` is not a Jinja template that compiles."""
    try:
        compile_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not compile: {e.message} (line {e.lineno}).") from None
