"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API on the chat path.

A request becomes a chat request (``services.api.responses_input``) and
runs through ``ChatServing.start``: the same template, tools, tool_choice,
structured outputs, sampling and limits. Its text becomes output items
(``services.api.responses_output``), streamed as typed SSE events or
returned whole, and the response is kept in the store
(``services.api.responses_store``) unless ``store`` is false, so that
``previous_response_id`` can continue the conversation.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from services.api import serving
from services.api.auth import tenant_of
from services.api.engine_client import EngineDeadError, EngineNotReadyError
from services.api.errors import APIError, bad_request
from services.api.field_table import RESPONSES, refuse_unsupported
from services.api.offload import run_blocking
from services.api.openai_schemas import ChatMessage, encode
from services.api.responses_input import chat_messages, chat_request, input_items, item_texts, output_as_input
from services.api.responses_output import EventLog, ResponseOutput
from services.api.responses_schemas import (
    IncompleteDetails,
    InputItem,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    StoredResponse,
    TextConfig,
    TextFormat,
)
from services.api.responses_store import ResponsesStore
from services.api.serving_chat import ChatRun, ChatServing
from services.api.streaming import SSEResponse, unless_disconnected

logger = logging.getLogger(__name__)
# A response the store keeps: its tenant, and the conversation it answered.
_Kept = tuple[str, list[InputItem]] | None
# The status of a response whose reply ended for this reason (else completed).
_STATUS_OF = {"length": "incomplete", "abort": "cancelled"}

# The chat request's names for what the Responses request calls otherwise (in 400s).
_PARAM_NAMES = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
    "messages": "input",
    "reasoning_effort": "reasoning",
}
_FUNCTION_PATH = re.compile(r"^(tools\[\d+\])\.function\.")


class ResponsesServing:
    def __init__(self, chat: ChatServing, store: ResponsesStore) -> None:
        self.chat, self.ctx, self.store = chat, chat.ctx, store

    async def create(self, request: Request, body: ResponsesRequest) -> Response:
        refuse_unsupported(body, RESPONSES)
        _check_options(body)
        tenant = tenant_of(request.scope)
        keep = self._keeps(body)
        conversation = self._history(tenant, body.previous_response_id) + input_items(body)
        limits = self.ctx.limits
        limits.check_message_count(len(conversation), "input", "input items")
        limits.check_text_size(item_texts(conversation), "input")
        run = await self._start(request, body, chat_messages(body.instructions, conversation))
        response = self._initial(body, run, keep)
        events = EventLog(enabled=body.stream)
        output = ResponseOutput(
            events,
            run.tools.output(),
            None if run.reasoning_parser is None else run.reasoning_parser(),
        )
        kept = (tenant, conversation) if keep else None
        if body.stream:
            return SSEResponse(self._events(run, response, output, kept))
        await unless_disconnected(request, serving.collect(run.runner))
        output.feed(run.choices[0].state.text, done=True)
        await self._complete(response, output, run, kept)
        return Response(encode(response), media_type="application/json")

    async def retrieve(self, request: Request, response_id: str) -> Response:
        _refuse_query(request)
        entry = self.store.get(tenant_of(request.scope), response_id)
        if entry is None:
            raise _not_found(response_id, "response_id")
        return Response(encode(entry.response), media_type="application/json")

    async def delete(self, request: Request, response_id: str) -> Response:
        _refuse_query(request)
        if not self.store.delete(tenant_of(request.scope), response_id):
            raise _not_found(response_id, "response_id")
        return Response(encode({"id": response_id, "object": "response", "deleted": True}))

    def _keeps(self, body: ResponsesRequest) -> bool:
        """Whether the response is stored: ``store`` (true unless said, as OpenAI), if the store is on."""
        if not self.store.enabled:
            if body.store:
                raise bad_request(
                    "This server keeps no responses (--responses-store-max-entries 0): send store: false.",
                    "store",
                )
            return False
        return body.store is not False

    def _history(self, tenant: str, previous_id: str | None) -> list[InputItem]:
        if previous_id is None:
            return []
        if not self.store.enabled:
            raise bad_request("This server keeps no responses to continue from.", "previous_response_id")
        entry = self.store.get(tenant, previous_id)
        if entry is None:
            raise _not_found(previous_id, "previous_response_id")
        return entry.conversation

    async def _start(self, request: Request, body: ResponsesRequest, messages: list[ChatMessage]) -> ChatRun:
        """The chat path's run of the request; its 400s name the Responses request's fields."""
        try:
            return await self.chat.start(request, chat_request(body, messages), "resp")
        except APIError as e:
            if e.param is not None:
                name = e.param.split("[", 1)[0].split(".", 1)[0]
                if name in _PARAM_NAMES:
                    e.message = e.message.replace(name, _PARAM_NAMES[name])
                    e.param = _PARAM_NAMES[name] + e.param[len(name) :]
                e.param = _FUNCTION_PATH.sub(r"\1.", e.param)
            raise

    def _initial(self, body: ResponsesRequest, run: ChatRun, keep: bool) -> ResponseObject:
        """The response as it starts: in progress, no output yet, the request's options echoed."""
        tool_choice = body.tool_choice
        if tool_choice is None:
            tool_choice = "auto" if body.tools else "none"
        text = body.text if body.text is not None and body.text.format is not None else None
        return ResponseObject(
            # Always the server's own: a stored response's id must not be one a client chose
            # (X-Request-Id), which another client of a key-less server could reuse.
            id="resp_" + uuid.uuid4().hex,
            created_at=int(time.time()),
            model=self.ctx.served_model_name,
            status="in_progress",
            instructions=body.instructions,
            metadata=body.metadata,
            max_output_tokens=body.max_output_tokens,
            parallel_tool_calls=body.parallel_tool_calls,
            previous_response_id=body.previous_response_id,
            reasoning=body.reasoning,
            store=keep,
            temperature=body.temperature,
            top_p=body.top_p,
            user=body.user,
            tools=list(body.tools or ()),
            tool_choice=tool_choice,
            text=text or TextConfig(format=TextFormat(type="text")),
        )

    async def _complete(
        self, response: ResponseObject, output: ResponseOutput, run: ChatRun, kept: _Kept
    ) -> None:
        """Fill in the finished response (status, items, usage) and store it."""
        choice = run.choices[0]
        reason = choice.state.finish_reason
        response.status = "completed" if reason is None else _STATUS_OF.get(reason, "completed")
        if reason == "length":
            response.incomplete_details = IncompleteDetails("max_output_tokens")
        output.finish(response.status)
        response.output = output.items
        usage = serving.usage_of(run.choices)
        details = usage.prompt_tokens_details
        cached_tokens = details.cached_tokens if details is not None else 0
        reasoning_tokens = 0
        if output.reasoning_text:  # the engine does not tell thinking tokens apart: count them again
            reasoning_tokens = len(
                await run_blocking(self.ctx.tokenizer.encode, output.reasoning_text, False)
            )
        response.usage = ResponseUsage(
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.total_tokens,
            InputTokensDetails(cached_tokens),
            OutputTokensDetails(min(reasoning_tokens, usage.completion_tokens)),
        )
        if kept is not None:
            tenant, conversation = kept
            entry = StoredResponse(response, conversation + output_as_input(output.items))
            if not self.store.put(tenant, entry):
                logger.warning("Response %s is larger than the whole store; it is not kept.", response.id)

    async def _events(
        self, run: ChatRun, response: ResponseObject, output: ResponseOutput, kept: _Kept
    ) -> AsyncGenerator[bytes, None]:
        events = output.events
        snapshot = msgspec.structs.replace(response)
        events.emit("response.created", response=snapshot)
        events.emit("response.in_progress", response=snapshot)
        try:
            async with contextlib.aclosing(run.runner.updates()) as updates:
                async for choice in updates:
                    serving.raise_if_failed(choice)
                    output.feed(choice.state.detokenizer.take_delta(choice.done), choice.done)
                    for event in events.take():
                        yield event
            await self._complete(response, output, run, kept)
            final = "response.completed" if response.status == "completed" else f"response.{response.status}"
            if final == "response.cancelled":
                final = "response.incomplete"
            events.emit(final, response=response)
        except (EngineDeadError, EngineNotReadyError) as e:
            _error_event(events, serving.engine_error(e))
        except APIError as e:
            _error_event(events, e)
        except Exception:
            logger.exception("Unexpected error while streaming a response.")
            _error_event(events, APIError("Internal server error.", 500))
        for event in events.take():
            yield event


def _error_event(events: EventLog, error: APIError) -> None:
    events.emit("error", code=str(error.status), message=error.message, param=error.param)


def _not_found(response_id: str, param: str) -> APIError:
    # Unknown, evicted and another key's look the same: nothing tells them apart.
    return APIError(f"Response with id {response_id!r} not found.", 404, param)


def _refuse_query(request: Request) -> None:
    """A stored response is read whole: no streaming it again, no ``include``."""
    for name in request.query_params:
        raise bad_request(f"The query parameter {name} is not supported here.", name)


def _check_options(body: ResponsesRequest) -> None:
    """400 for the values of honoured fields weft cannot serve."""
    _check_metadata(body.metadata)
    if body.include:
        raise bad_request(f"include is not supported: {body.include[0]!r} is not returned here.", "include")
    if body.truncation == "auto":
        raise bad_request('truncation "auto" is not supported: the input is never cut.', "truncation")
    if body.text is not None and body.text.verbosity is not None:
        raise bad_request("text.verbosity is not supported.", "text")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true.", "stream_options")


# OpenAI's bounds on metadata: it is kept with the response.
_MAX_METADATA_PAIRS, _MAX_METADATA_KEY, _MAX_METADATA_VALUE = 16, 64, 512


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > _MAX_METADATA_PAIRS:
        raise bad_request(f"metadata holds at most {_MAX_METADATA_PAIRS} pairs.", "metadata")
    for key, value in metadata.items():
        if len(key) > _MAX_METADATA_KEY or len(value) > _MAX_METADATA_VALUE:
            raise bad_request(
                f"metadata keys are at most {_MAX_METADATA_KEY} characters, values {_MAX_METADATA_VALUE}.",
                "metadata",
            )
