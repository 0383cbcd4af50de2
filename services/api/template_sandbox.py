"""Rendering a request's own chat template (``--trust-request-chat-template``) in a subprocess.

A request's template is code whose cost its sender picks: nested loops that
never end, a string grown to gigabytes. Rendered in the API process, one
such template held a thread of the pool (and with it every later chat
request), took the process to 4 GB, and kept it alive after SIGTERM. Here
each render runs in a fresh child process (``python -m
services.api.template_sandbox``) that:

- has an address-space limit (``MEMORY_BYTES``) and a CPU-time limit, so a
  runaway template fails there, not in the server;
- is killed by the server past ``TIMEOUT_S`` (and ends itself by an alarm
  shortly after, should the server be gone), or when the request is
  cancelled (its client left, the server stops);
- renders in the same jinja2 sandbox as the model's template, which also
  refuses ``*`` and ``**`` results past a size (``chat_template``).

At most ``MAX_CONCURRENT`` renders run at once; more wait their turn. The
job and the answer cross the pipe as msgspec JSON, never pickled. A template
longer than ``MAX_TEMPLATE_CHARS`` is refused before any of this.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal
import sys
from typing import Any

import msgspec

MAX_TEMPLATE_CHARS = 64 * 1024  # the largest model templates are about 20 KB
TIMEOUT_S = 5.0
MEMORY_BYTES = 1 << 30
MAX_CONCURRENT = 2
# What a render's error may say (the rendered text itself is bounded by the job's max_chars).
_MAX_MESSAGE_CHARS = 2000


class RenderJob(msgspec.Struct):
    source: str
    messages: list[Any]
    add_generation_prompt: bool
    continue_final_message: bool
    tools: list[Any] | None
    bos_token: str
    eos_token: str
    kwargs: dict[str, Any]
    max_chars: int  # the longest text the server takes (--max-prompt-chars)


class RenderResult(msgspec.Struct):
    text: str | None = None
    # template (its raise_exception), continue, syntax, refused (the sandbox), memory, too_long, failed
    error_kind: str | None = None
    message: str = ""
    lineno: int = 0


class TemplateSandboxError(ValueError):
    """The request's template was stopped: too slow, too big, or an operation the sandbox refuses."""


_slots: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}


def _slot() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    if loop not in _slots:
        _slots.clear()  # one event loop serves; a test's earlier loops are gone
        _slots[loop] = asyncio.Semaphore(MAX_CONCURRENT)
    return _slots[loop]


async def render(job: RenderJob, *, timeout_s: float | None = None, memory_bytes: int | None = None) -> str:
    """The rendered text; the template's own errors as ``chat_template`` raises them
    (``ChatTemplateError``, ``ContinueFinalMessageError``, ``jinja2.TemplateSyntaxError``),
    ``TemplateSandboxError`` when the sandbox stopped it, ``RuntimeError`` for anything else.
    The limits default to ``TIMEOUT_S`` and ``MEMORY_BYTES``."""
    async with _slot():
        result = await _run(job, timeout_s or TIMEOUT_S, memory_bytes or MEMORY_BYTES)
    return _text_or_raise(result)


async def _run(job: RenderJob, timeout_s: float, memory_bytes: int) -> RenderResult:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.api.template_sandbox",
        str(memory_bytes),
        str(timeout_s),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,  # a terminal's Ctrl-C goes to the server, which ends it
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(msgspec.json.encode(job)), timeout_s)
    except TimeoutError:
        raise TemplateSandboxError(
            f"The chat template did not finish rendering within {timeout_s:g} s and was stopped."
        ) from None
    finally:
        if proc.returncode is None:  # timed out, or the request was cancelled
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    if proc.returncode != 0 or not out:
        raise TemplateSandboxError(
            "The chat template was stopped while rendering: it used more memory or CPU than a "
            "request's template may."
        )
    try:
        return msgspec.json.decode(out, type=RenderResult)
    except msgspec.DecodeError as e:
        raise RuntimeError(f"The chat template sandbox answered garbage: {e}") from None


def _text_or_raise(result: RenderResult) -> str:
    from services.api.chat_template import ChatTemplateError, ContinueFinalMessageError

    if result.error_kind is None and result.text is not None:
        return result.text
    kind, message = result.error_kind, result.message
    if kind == "template":
        raise ChatTemplateError(message)
    if kind == "continue":
        raise ContinueFinalMessageError(message)
    if kind == "syntax":
        import jinja2

        raise jinja2.TemplateSyntaxError(message, result.lineno)
    if kind == "refused":
        raise TemplateSandboxError(f"The chat template did something the sandbox refuses: {message}")
    if kind == "memory":
        raise TemplateSandboxError("The chat template used more memory than a request's template may.")
    if kind == "too_long":
        raise TemplateSandboxError(
            f"The chat template rendered a text longer than this server takes ({message} characters, "
            "--max-prompt-chars)."
        )
    raise RuntimeError(f"The chat template failed: {message}")


# ---- the child


def _limit(memory_bytes: int, timeout_s: float) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    cpu = int(timeout_s) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    signal.alarm(int(timeout_s) + 5)  # ends itself should nobody be left to kill it


def _render(job: RenderJob) -> RenderResult:
    import jinja2
    from jinja2.exceptions import SecurityError

    from services.api.chat_template import ChatTemplateError, ContinueFinalMessageError
    from services.api.chat_template import render as render_template

    try:
        text = render_template(
            job.source,
            job.messages,
            add_generation_prompt=job.add_generation_prompt,
            continue_final_message=job.continue_final_message,
            tools=job.tools,
            bos_token=job.bos_token,
            eos_token=job.eos_token,
            **job.kwargs,
        )
    except ChatTemplateError as e:
        return RenderResult(error_kind="template", message=str(e)[:_MAX_MESSAGE_CHARS])
    except ContinueFinalMessageError as e:
        return RenderResult(error_kind="continue", message=str(e))
    except jinja2.TemplateSyntaxError as e:
        return RenderResult(error_kind="syntax", message=str(e.message)[:_MAX_MESSAGE_CHARS], lineno=e.lineno)
    except SecurityError as e:
        return RenderResult(error_kind="refused", message=str(e)[:_MAX_MESSAGE_CHARS])
    except MemoryError:
        return RenderResult(error_kind="memory")
    except Exception as e:  # the template is the client's code: any failure is theirs
        return RenderResult(error_kind="failed", message=type(e).__name__)
    if len(text) > job.max_chars:
        return RenderResult(error_kind="too_long", message=str(job.max_chars))
    return RenderResult(text=text)


def main() -> int:
    memory_bytes, timeout_s = int(sys.argv[1]), float(sys.argv[2])
    _limit(memory_bytes, timeout_s)
    job = msgspec.json.decode(sys.stdin.buffer.read(), type=RenderJob)
    try:
        answer = msgspec.json.encode(_render(job))
    except MemoryError:
        answer = msgspec.json.encode(RenderResult(error_kind="memory"))
    sys.stdout.buffer.write(answer)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
