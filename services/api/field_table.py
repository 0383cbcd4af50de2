"""Every request field of /v1/completions, /v1/chat/completions and /v1/responses, and what weft does with it.

This table is data: the README's field table is written from it, the routes
refuse the fields it marks ``REFUSED``, and a test walks OpenAI's own
request schema (the ``openai`` package's TypedDicts) to check that every
field is listed here and behaves as listed, sending each ``example``.

- ``HONOURED``: the field changes the output as OpenAI / vLLM document it.
- ``REFUSED``: a 400 naming the field whenever it is set (not null).
- ``NO_EFFECT``: accepted and ignored, because it has nothing to do on a
  self-hosted server (billing, storage, tiers, abuse tracking).

Anything not in the table is an unknown field: a 400 naming it, unless the
server runs with ``--allow-unknown-fields`` (then a logged warning).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from services.api.errors import bad_request

HONOURED = "honoured"
REFUSED = "refused (400)"
NO_EFFECT = "accepted without effect"


@dataclass(frozen=True)
class FieldRule:
    status: str
    example: Any  # a value a test sends to check the status
    note: str = ""
    owner: str = ""  # the work that declares the field, when it is not on every branch yet
    needs: tuple[tuple[str, Any], ...] = ()  # other fields the example must be sent with


def _h(example: Any, note: str = "", owner: str = "") -> FieldRule:
    return FieldRule(HONOURED, example, note, owner)


def _r(example: Any, note: str) -> FieldRule:
    return FieldRule(REFUSED, example, note)


def _x(example: Any, note: str = "") -> FieldRule:
    return FieldRule(NO_EFFECT, example, note)


_WEATHER_FUNCTION: dict[str, object] = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
_WEATHER_TOOL = {"type": "function", "function": _WEATHER_FUNCTION}

# Fields both endpoints take, with the same meaning.
_SHARED: dict[str, FieldRule] = {
    "model": _h("SmolLM2-135M-Instruct", "must name the served model (a 400 otherwise)"),
    "temperature": _h(0.0),
    "top_p": _h(0.9),
    "n": _h(2),
    "stop": _h(["\n\n"], "left out of the text unless include_stop_str_in_output; held back while streaming"),
    "seed": _h(7),
    "stream": _h(False),
    "stream_options": FieldRule(
        HONOURED,
        {"include_usage": True, "continuous_usage_stats": True},
        "include_usage, continuous_usage_stats (usage on every chunk); 400 without stream",
        needs=(("stream", True),),
    ),
    "presence_penalty": _h(0.5),
    "frequency_penalty": _h(0.5),
    "logit_bias": _h({"42": 5.0}, "token id -> bias in [-100, 100]; ids checked against the vocabulary"),
    "user": _x("user-1", "no accounts here"),
    "metadata": _x({"k": "v"}, "nothing is stored"),
    "store": _x(False, "nothing is stored"),
    "service_tier": _x("auto", "one tier"),
    # vLLM's extensions.
    "top_k": _h(20),
    "min_p": _h(0.05),
    "repetition_penalty": _h(1.1),
    "ignore_eos": _h(False),
    "min_tokens": _h(1, "EOS, stop tokens and stop strings are held back until this many tokens exist"),
    "stop_token_ids": _h([2], "the token's text is left out unless include_stop_str_in_output"),
    "skip_special_tokens": _h(True),
    "spaces_between_special_tokens": _h(
        False,
        "vLLM's; false: with special tokens shown, no space between two added tokens in a row "
        "(only decoders that put one there, such as WordPiece's, change)",
    ),
    "include_stop_str_in_output": _h(False),
    "priority": _h(0, "non-zero needs --scheduling-policy priority"),
    "cache_salt": _h("tenant-a"),
    "allowed_token_ids": _h([42, 43]),
    "bad_words": _h(["Paris"], "banned as token sequences, with and without a leading space"),
    "response_format": _h({"type": "json_object"}),
    "structured_outputs": _h({"regex": "[a-z]+"}),
    "guided_json": _h({"type": "object"}),
    "guided_regex": _h("[a-z]+"),
    "guided_choice": _h(["yes", "no"]),
    "guided_grammar": _h('root ::= "yes" | "no"'),
    "kv_transfer_params": _h(None, "set by the P/D proxy"),
}

COMPLETIONS: dict[str, FieldRule] = {
    "prompt": _h("The capital of France is"),
    "max_tokens": _h(8, "completions: 0 only with echo, which then answers the prompt alone (vLLM)"),
    "logprobs": _h(2),
    "echo": _h(True, "the prompt's text (and, with logprobs, its logprobs) in front of the output"),
    "best_of": _h(1, "only equal to n: weft returns every sequence it generates"),
    "suffix": _r("!", "insertion is not supported by the model family"),
    "prompt_logprobs": _h(1, "vLLM's; not with stream"),
    "add_special_tokens": _h(True),
    **_SHARED,
}

CHAT: dict[str, FieldRule] = {
    "messages": _h([{"role": "user", "content": "Hi"}]),
    "max_tokens": _h(8),
    "max_completion_tokens": _h(8),
    "logprobs": _h(True),
    "top_logprobs": FieldRule(HONOURED, 2, "needs logprobs: true", needs=(("logprobs", True),)),
    **_SHARED,
    "add_generation_prompt": _h(True),
    "tools": FieldRule(
        HONOURED,
        [_WEATHER_TOOL],
        "tool_choice auto (the default with tools) needs --enable-auto-tool-choice",
        needs=(("tool_choice", "required"),),
    ),
    "tool_choice": _h("none"),
    "parallel_tool_calls": _h(True),
    "chat_template": _h(
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        "only with --trust-request-chat-template; else a 400",
    ),
    "chat_template_kwargs": _h({}),
    "continue_final_message": _h(False),
    "echo": _h(True, "vLLM's: the final message leads the reply when it is the reply's role"),
    "audio": _r({"voice": "alloy", "format": "wav"}, "text-only models"),
    "modalities": _r(["audio"], "text-only models: leave it out"),
    "prediction": _r({"type": "content", "content": "x"}, "predicted outputs are not supported"),
    "functions": _r([_WEATHER_FUNCTION], "deprecated by OpenAI: use tools"),
    "function_call": _r("auto", "deprecated by OpenAI: use tool_choice"),
    "reasoning_effort": _h(
        "low",
        "handed to the chat template as `reasoning_effort`; a template that does not read it "
        "(the default model's) is unchanged by it",
    ),
    "verbosity": _r("low", "not supported"),
    "web_search_options": _r({}, "no web search"),
    "moderation": _r({"model": "omni-moderation-latest"}, "no moderation"),
    "prompt_cache_key": _x("key-1", "prefix caching is automatic"),
    "prompt_cache_options": _x({}, "prefix caching is automatic"),
    "prompt_cache_retention": _x("in_memory", "prefix caching is automatic"),
    "safety_identifier": _x("user-1", "no abuse tracking"),
}


_FLAT_WEATHER_TOOL = {"type": "function", **_WEATHER_FUNCTION}

# POST /v1/responses: what each field of OpenAI's ResponseCreateParams does here.
RESPONSES: dict[str, FieldRule] = {
    "model": _SHARED["model"],
    "input": _h("Hi", "a string, or message, function_call, function_call_output and reasoning items"),
    "instructions": _h("Answer briefly.", "a system message first; not carried by previous_response_id"),
    "max_output_tokens": _h(8, "a reply cut by it is `incomplete` (reason max_output_tokens)"),
    "temperature": _h(0.0),
    "top_p": _h(0.9),
    "tools": FieldRule(
        HONOURED,
        [_FLAT_WEATHER_TOOL],
        "function tools only (other types: 400); auto needs --enable-auto-tool-choice",
        needs=(("tool_choice", "required"),),
    ),
    "tool_choice": _h("none", "none, auto, required or {type: function, name}"),
    "parallel_tool_calls": _h(True),
    "text": _h(
        {"format": {"type": "json_object"}}, "format text, json_object or json_schema; verbosity: 400"
    ),
    "reasoning": _h(
        {"effort": "low"},
        "effort goes to the chat template as `reasoning_effort`; summary is accepted, the thinking "
        "comes whole (reasoning_text), never summarized",
    ),
    "stream": _h(False),
    "stream_options": FieldRule(
        NO_EFFECT, {"include_obfuscation": False}, "no obfuscation padding", needs=(("stream", True),)
    ),
    "store": _h(True, "kept in the API process's memory, per API key (--responses-store-max-*)"),
    "previous_response_id": _h(None, "the stored conversation goes first; 404 if unknown"),
    "metadata": _h({"k": "v"}, "echoed and stored"),
    "user": _SHARED["user"],
    "include": _h([], "only empty: no encrypted reasoning, logprobs or hosted-tool outputs"),
    "truncation": _h("disabled", "only disabled: a conversation longer than the context is a 400"),
    "prompt_cache_key": _x("key-1", "prefix caching is automatic"),
    "prompt_cache_options": _x({}, "prefix caching is automatic"),
    "prompt_cache_retention": _x("in_memory", "prefix caching is automatic"),
    "safety_identifier": _x("user-1", "no abuse tracking"),
    "service_tier": _x("auto", "one tier"),
    "access_programs": _r({}, "no access programs"),
    "background": _r(True, "responses run in the foreground"),
    "background_options": _r({}, "responses run in the foreground"),
    "context_management": _r([], "no context compaction"),
    "conversation": _r("conv_1", "no conversations API: use previous_response_id"),
    "image": _r({}, "text-only models"),
    "max_tool_calls": _r(1, "not supported"),
    "moderation": _r({"model": "omni-moderation-latest"}, "no moderation"),
    "prompt": _r({"id": "pmpt_1"}, "no stored prompts"),
    "top_logprobs": _r(2, "no logprobs on Responses"),
}


def refuse_unsupported(body: msgspec.Struct, table: dict[str, FieldRule]) -> None:
    """400 for the first field the table refuses that the body sets."""
    for name, rule in table.items():
        if rule.status == REFUSED and getattr(body, name, None) is not None:
            raise bad_request(f"{name} is not supported: {rule.note}.", name)


def responses_markdown_table() -> str:
    """The README's table of /v1/responses fields."""
    rows = ["| Field | /v1/responses | Notes |", "|---|---|---|"]
    for name in sorted(RESPONSES):
        rule = RESPONSES[name]
        rows.append(f"| `{name}` | {rule.status} | {rule.note} |")
    return "\n".join(rows) + "\n"


def markdown_table() -> str:
    """The README's table: one row per field, its status on each endpoint, and why."""
    rows = ["| Field | /v1/completions | /v1/chat/completions | Notes |", "|---|---|---|---|"]
    for name in sorted(COMPLETIONS.keys() | CHAT.keys()):
        rules = [table.get(name) for table in (COMPLETIONS, CHAT)]
        notes = "; ".join(dict.fromkeys(r.note for r in rules if r is not None and r.note))
        statuses = [r.status if r is not None else "-" for r in rules]
        rows.append(f"| `{name}` | {statuses[0]} | {statuses[1]} | {notes} |")
    return "\n".join(rows) + "\n"
