"""For the chat tests: a fake engine that writes a given text, and a template that shows tools."""

from __future__ import annotations

from services.api.chat_args import ChatSettings
from tests.api.fake_engine_client import FakeEngineClient, make_app, openai_client, tokenizer

END = tokenizer().encode("<|im_end|>", add_special_tokens=False)

# Shows what the renderer hands a template: the tools, each message's calls
# (arguments as a dict: ``.city`` reads it) and which call a tool message answers.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson(sort_keys=true) }} city={{ c.function.arguments.city }}{% endfor %}"
    "{% if m.tool_call_id %} (answers {{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def scripted(text: str, settings: ChatSettings | None = None):
    """An openai client whose model writes ``text`` then ends its turn (send ``stop_token_ids=END``)."""
    engine = FakeEngineClient()
    engine.script = tokenizer().encode(text, add_special_tokens=False) + END
    app, _ = make_app(engine, chat=settings)
    return openai_client(app), engine


def prompt_text(engine: FakeEngineClient, i: int = 0) -> str:
    return tokenizer().decode(engine.requests[i].prompt_token_ids, skip_special_tokens=False)
