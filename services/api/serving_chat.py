"""POST /v1/chat/completions: messages through the chat template, then text."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import Response

from protocol import SamplingParams
from services.api import serving, template_sandbox
from services.api.chat_args import ChatSettings
from services.api.chat_template import RESERVED_KWARGS, ChatTemplateError, ContinueFinalMessageError
from services.api.errors import bad_request
from services.api.field_table import CHAT, refuse_unsupported
from services.api.offload import run_blocking
from services.api.openai_schemas import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionFinalChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatMessage,
    ChatReasoningMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    TokenizeRequest,
    TopLogprob,
    UsageInfo,
    encode,
)
from services.api.output_processor import Logprob
from services.api.reasoning_parsers import ReasoningParser
from services.api.serving import Choice, ServingContext
from services.api.streaming import SSEResponse, unless_disconnected, usage_modes
from services.api.tool_calling import (
    ToolOutput,
    ToolStrategy,
    history_tool_calls,
    resolve_tool_choice,
    tool_dicts,
)

logger = logging.getLogger(__name__)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as the chat template sees them (text parts joined)."""
    if not messages:
        raise bad_request("messages must hold at least one message.", "messages")
    return [_message_dict(i, m) for i, m in enumerate(messages)]


def _message_dict(i: int, m: ChatMessage) -> dict[str, Any]:
    content = message_text(i, m)
    if content is None and m.role == "assistant":
        content = ""  # an assistant turn of only tool calls (vLLM renders it so)
    message: dict[str, Any] = {"role": m.role, "content": content}
    if m.name is not None:
        message["name"] = m.name
    if m.reasoning_content is not None:
        if m.role != "assistant":
            raise bad_request(
                "Only assistant messages carry reasoning_content.", f"messages[{i}].reasoning_content"
            )
        message["reasoning_content"] = m.reasoning_content  # Qwen3's and R1's templates read it
    if m.tool_calls is not None:
        if m.role != "assistant":
            raise bad_request("Only assistant messages carry tool_calls.", f"messages[{i}].tool_calls")
        message["tool_calls"] = history_tool_calls(m.tool_calls)
    if m.role == "tool":
        if m.tool_call_id is None:
            raise bad_request(
                "A tool message needs tool_call_id: the id of the call it answers.",
                f"messages[{i}].tool_call_id",
            )
        message["tool_call_id"] = m.tool_call_id
    return message


def message_text(i: int, m: ChatMessage) -> str | None:
    content = m.content
    if isinstance(content, list):
        if any(part.type != "text" or part.text is None for part in content):
            raise bad_request("Only text content parts are supported.", f"messages[{i}].content")
        content = "".join(part.text for part in content)  # type: ignore[misc]
    return content


def check_messages_size(ctx: ServingContext, messages: list[ChatMessage]) -> None:
    """400 for more messages, or more text in them, than this server takes (before any work)."""
    ctx.limits.check_message_count(len(messages))
    ctx.limits.check_text_size(message_texts(messages), "messages")


def message_texts(messages: list[ChatMessage]) -> Iterator[str]:
    """Every piece of text the messages hold."""
    for m in messages:
        if isinstance(m.content, str):
            yield m.content
        elif isinstance(m.content, list):
            yield from (part.text for part in m.content if part.text is not None)
        if m.reasoning_content is not None:
            yield m.reasoning_content


def chat_prompt_ids(
    ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool, **template_args: Any
) -> list[int]:
    """The prompt's token ids; ``template_args`` go to ``Tokenizer.apply_chat_template``."""
    dicts = message_dicts(messages)
    with _template_errors():
        text = ctx.tokenizer.apply_chat_template(
            dicts, add_generation_prompt=add_generation_prompt, **template_args
        )
    return rendered_prompt_ids(ctx, text)


async def render_prompt_ids(
    ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool, **template_args: Any
) -> list[int]:
    """``chat_prompt_ids`` off the event loop; a request's own template renders in a subprocess
    (``services.api.template_sandbox``), the server's in the thread pool."""
    source = template_args.pop("chat_template", None)
    if source is None:
        return await run_blocking(chat_prompt_ids, ctx, messages, add_generation_prompt, **template_args)
    dicts = message_dicts(messages)
    continue_final = template_args.pop("continue_final_message", False)
    tools = template_args.pop("tools", None)
    job = template_sandbox.RenderJob(
        source,
        dicts,
        add_generation_prompt,
        continue_final,
        tools,
        ctx.tokenizer.bos_token or "",
        ctx.tokenizer.eos_token or "",
        template_args,
        ctx.limits.max_prompt_chars,
    )
    with _template_errors():
        text = await template_sandbox.render(job)
    return await run_blocking(rendered_prompt_ids, ctx, text)


def rendered_prompt_ids(ctx: ServingContext, text: str) -> list[int]:
    # Short messages can still render into a long text: bound what gets tokenized.
    ctx.limits.check_text_size([text], "messages")
    # The template already wrote the special tokens it wants.
    return ctx.tokenizer.encode(text, add_special_tokens=False)


@contextlib.contextmanager
def _template_errors() -> Iterator[None]:
    """The chat template's failures as 400s."""
    try:
        yield
    except ChatTemplateError as e:  # the template's raise_exception: its words are for the client
        raise bad_request(str(e), "messages") from e
    except ContinueFinalMessageError as e:
        raise bad_request(str(e), "continue_final_message") from e
    except jinja2.TemplateSyntaxError as e:  # only a request's own template can get this far
        raise bad_request(
            f"The chat template does not compile: {e.message} (line {e.lineno}).", "chat_template"
        ) from e
    except template_sandbox.TemplateSandboxError as e:
        raise bad_request(str(e), "chat_template") from e
    # The template is code run on the client's messages: whatever else it
    # raises (a None where it wants a string...) is a bad request. Only the
    # template's own message is shown: other errors' text describes the
    # template's internals, not the client's mistake.
    except Exception as e:
        logger.info("The chat template failed on a request's messages: %r", e)
        raise bad_request("The chat template could not render these messages.", "messages") from e


@dataclass
class ChatRun:
    """A chat request checked and admitted: its engine requests, and how to read their text."""

    request_id: str
    choices: list[Choice]
    runner: serving.ChoiceRunner
    tools: ToolStrategy  # what tool_choice asks: ``tools.output()`` reads one choice's calls
    reasoning_parser: type[ReasoningParser] | None  # splits thinking off (None: no split)


class ChatServing:
    def __init__(self, ctx: ServingContext, settings: ChatSettings | None = None) -> None:
        self.ctx = ctx
        self.settings = settings or ChatSettings()

    async def create(self, request: Request, body: ChatCompletionRequest) -> Response:
        run = await self.start(request, body, "chatcmpl")
        ctx = self.ctx
        include_usage, continuous = usage_modes(ctx.options, body)
        view = _ChatView(
            run.request_id,
            int(time.time()),
            ctx.served_model_name,
            run.tools,
            _reply_role(body),
            _echo_text(body, _reply_role(body)),
            continuous,
            run.reasoning_parser,
        )
        choices, runner = run.choices, run.runner
        if body.stream:
            usage = (lambda: view.usage_chunk(choices)) if include_usage else None
            return SSEResponse(
                serving.sse_events(runner, view.chunk, head=view.head_chunks(choices), usage_chunk=usage)
            )
        await unless_disconnected(request, serving.collect(runner))
        return Response(encode(view.response(choices)), media_type="application/json")

    async def start(self, request: Request, body: ChatCompletionRequest, id_prefix: str) -> ChatRun:
        """Check ``body``, render its prompt and admit its engine requests (the
        Responses API comes through here too, with a chat request made from its own)."""
        arrival = time.monotonic()
        ctx = self.ctx
        ctx.check_model(body.model)
        refuse_unsupported(body, CHAT)
        serving.check_kv_transfer_caller(ctx, request, body)
        ctx.limits.check_tool_count(len(body.tools or ()), "tools")
        tool_choice = resolve_tool_choice(body, self.settings.auto_parser)
        check_messages_size(ctx, body.messages)
        prompt = await render_prompt_ids(
            ctx, body.messages, body.add_generation_prompt, **self.template_args(body)
        )
        request_id = serving.new_request_id(id_prefix, request)
        session = serving.session_key(request, body)
        # Checks, sampling parameters and engine requests, once for the whole request, off the loop.
        params, choices = await run_blocking(
            self._choices, request_id, body, prompt, tool_choice, arrival, session
        )
        runner = ctx.admit(request, choices)  # 503 + Retry-After when the engines are full
        # A constraint binds from the first token, so a constrained reply holds no thinking to split off.
        reasoning = None if params.structured_outputs is not None else self.settings.reasoning_parser_class
        return ChatRun(request_id, choices, runner, tool_choice, reasoning)

    def _choices(
        self,
        request_id: str,
        body: ChatCompletionRequest,
        prompt: list[int],
        tool_choice: ToolStrategy,
        arrival: float,
        session: str | None,
    ) -> tuple[SamplingParams, list[Choice]]:
        ctx = self.ctx
        serving.check_prompt_ids(ctx, prompt, "messages")
        if body.max_completion_tokens is not None:
            max_tokens = serving.resolve_max_tokens(
                ctx, body.max_completion_tokens, len(prompt), "max_completion_tokens"
            )
        else:
            max_tokens = serving.resolve_max_tokens(ctx, body.max_tokens, len(prompt), "max_tokens")
        params = serving.make_sampling_params(ctx, body, max_tokens, _num_logprobs(body))
        params = tool_choice.sampling(params)  # forced calls' constraint, a parser's special tokens
        return params, serving.make_choices(ctx, request_id, [prompt], [params], body, arrival, session)

    def template_args(self, body: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
        """What the chat template gets besides the messages; 400 for options that do not fit."""
        if body.continue_final_message and body.add_generation_prompt:
            raise bad_request(
                "Cannot set both continue_final_message and add_generation_prompt to true: "
                "set add_generation_prompt to false to continue the final message.",
                "continue_final_message",
            )
        if body.chat_template is not None and not self.settings.trust_request_chat_template:
            raise bad_request(
                "This server does not run chat templates sent with requests "
                "(start it with --trust-request-chat-template to allow them).",
                "chat_template",
            )
        if body.chat_template is not None and len(body.chat_template) > template_sandbox.MAX_TEMPLATE_CHARS:
            raise bad_request(
                f"chat_template is {len(body.chat_template)} characters; a request's template may "
                f"have at most {template_sandbox.MAX_TEMPLATE_CHARS}.",
                "chat_template",
            )
        kwargs = body.chat_template_kwargs or {}
        if reserved := sorted(RESERVED_KWARGS & kwargs.keys()):
            raise bad_request(
                f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own fields set them.",
                "chat_template_kwargs",
            )
        effort = getattr(body, "reasoning_effort", None)
        if effort is not None:
            kwargs = {
                "reasoning_effort": effort,
                **kwargs,
            }  # templates that take it read it; others ignore it
        return {
            **kwargs,
            "tools": tool_dicts(body.tools),
            "chat_template": body.chat_template,
            "continue_final_message": body.continue_final_message,
        }


def _reply_role(body: ChatCompletionRequest) -> str:
    # vLLM: without a generation prompt the reply goes on in the final message's role.
    return "assistant" if body.add_generation_prompt else body.messages[-1].role


def _echo_text(body: ChatCompletionRequest, role: str) -> str:
    """With ``echo``, the final message's content leads the reply when it is the reply's role (vLLM)."""
    if not body.echo or body.messages[-1].role != role:
        return ""
    return message_text(len(body.messages) - 1, body.messages[-1]) or ""


def _num_logprobs(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true.", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


class _ChatView:
    """Turns choices into OpenAI's chat completion objects."""

    def __init__(
        self,
        request_id: str,
        created: int,
        model: str,
        tools: ToolStrategy,
        role: str = "assistant",
        echo: str = "",
        continuous_usage: bool = False,
        reasoning_parser: type[ReasoningParser] | None = None,
    ) -> None:
        self.request_id, self.created, self.model = request_id, created, model
        self.role, self.echo = role, echo
        self.tools = tools
        self.tool_outputs: dict[int, ToolOutput] = {}
        self._continuous_usage = continuous_usage
        self.reasoning_parser = reasoning_parser
        self.reasoning: dict[int, ReasoningParser] = {}

    def _reasoning(self, choice: Choice) -> ReasoningParser | None:
        if self.reasoning_parser is None:
            return None
        if choice.index not in self.reasoning:
            self.reasoning[choice.index] = self.reasoning_parser()
        return self.reasoning[choice.index]

    def _tools(self, choice: Choice) -> ToolOutput:
        if choice.index not in self.tool_outputs:
            self.tool_outputs[choice.index] = self.tools.output()
        return self.tool_outputs[choice.index]

    def head_chunks(self, choices: list[Choice]) -> tuple[ChatCompletionChunk, ...]:
        # OpenAI's first chunk of each choice names the role, with empty content;
        # an echo follows as the choice's first text.
        head = [
            self._chunk([ChatStreamChoice(c.index, DeltaMessage(self.role, ""))], self._usage(c))
            for c in choices
        ]
        if self.echo:
            head += [
                self._chunk([ChatStreamChoice(c.index, DeltaMessage(content=self.echo))], self._usage(c))
                for c in choices
            ]
        return tuple(head)

    def _usage(self, choice: Choice) -> UsageInfo | None:
        """Usage of one choice so far, on every chunk with continuous_usage_stats (vLLM)."""
        return serving.choice_usage(choice) if self._continuous_usage else None

    def chunk(self, choice: Choice) -> ChatCompletionChunk | None:
        text = choice.state.detokenizer.take_delta(choice.done)
        reasoning, parser = "", self._reasoning(choice)
        if parser is not None:
            reasoning, text = parser.feed(text, choice.done)
        tools = self._tools(choice)
        text, tool_deltas = tools.feed(text, choice.done)
        entries = choice.take_logprobs()
        if not text and not reasoning and not tool_deltas and not entries and not choice.done:
            return None
        logprobs = self._logprobs(choice, entries)
        finish, stop = _finish(choice, tools)
        delta = DeltaMessage(
            content=text or None,
            tool_calls=tool_deltas or None,
            reasoning_content=reasoning or None,
            reasoning=reasoning or None,
        )
        if not text and not reasoning and not tool_deltas and not choice.done:
            delta.content = ""  # a logprobs-only chunk still says it adds no text
        shown = [ChatStreamChoice(choice.index, delta, logprobs, finish, stop)]
        if choice.done and choice.state.kv_transfer_params is not None:
            return ChatCompletionFinalChunk(
                self.request_id,
                self.created,
                self.model,
                shown,
                self._usage(choice),
                kv_transfer_params=choice.state.kv_transfer_params,
            )
        return self._chunk(shown, self._usage(choice))

    def usage_chunk(self, choices: list[Choice]) -> ChatCompletionChunk:
        return self._chunk([], usage=serving.usage_of(choices))

    def response(self, choices: list[Choice]) -> ChatCompletionResponse:
        shown = []
        for c in choices:
            reasoning: str | None = None
            content: str | None = c.state.text
            parser = self._reasoning(c)
            if parser is not None:
                reasoning, content = parser.split(c.state.text)
            tools = self._tools(c)
            content, calls = tools.complete(content)
            if self.echo:
                content = self.echo + (content or "")
            message = (
                ChatResponseMessage(self.role, content, calls)
                if parser is None
                else ChatReasoningMessage(self.role, content, calls, reasoning, reasoning)
            )
            finish, stop = _finish(c, tools)
            shown.append(ChatChoice(c.index, message, self._logprobs(c, c.take_logprobs()), finish, stop))
        return ChatCompletionResponse(
            self.request_id,
            self.created,
            self.model,
            shown,
            serving.usage_of(choices),
            kv_transfer_params=serving.kv_transfer_params_of(choices),
        )

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.request_id, self.created, self.model, choices, usage)

    def _logprobs(self, choice: Choice, entries: list[dict[int, Logprob]]) -> ChatChoiceLogprobs | None:
        if choice.state.logprobs is None:
            return None
        top_n = choice.request.sampling_params.logprobs or 0
        return ChatChoiceLogprobs([_entry(e, top_n) for e in entries])


def _finish(choice: Choice, tools: ToolOutput) -> tuple[str | None, int | str | None]:
    if not choice.done:
        return None, None
    reason = choice.state.finish_reason
    if reason == "stop" and tools.called:
        reason = "tool_calls"  # the reply ended after calling tools: the client runs them next
    return reason, choice.state.stop_reason


def _entry(entry: dict[int, Logprob], top_n: int) -> ChatLogprobEntry:
    chosen = next(iter(entry.values()))  # the sampled token comes first
    ranked = sorted(
        (lp for lp in entry.values() if lp.rank is not None and lp.rank <= top_n), key=lambda lp: lp.rank or 0
    )
    top = [TopLogprob(_token(lp), serving.shown_logprob(lp.logprob), _bytes(lp)) for lp in ranked]
    return ChatLogprobEntry(_token(chosen), serving.shown_logprob(chosen.logprob), _bytes(chosen), top)


def _token(lp: Logprob) -> str:
    return lp.decoded_token or ""


def _bytes(lp: Logprob) -> list[int]:
    return list(_token(lp).encode("utf-8", errors="replace"))
