"""CPU-heavy work of the API process, run off the event loop.

Tokenizing a 4 MiB prompt, rendering a chat template or decoding a long
token list takes seconds of CPU; on the loop it would freeze every other
request (their streams, their health checks) for that long. These run on a
small thread pool instead, as vLLM's API server does with its tokenizer:
HF ``tokenizers`` releases the GIL while it works, and Python work (jinja)
is at least preempted every switch interval, so the loop keeps turning.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

T = TypeVar("T")
P = ParamSpec("P")

# A few threads: enough that one huge request does not queue the small ones
# behind it, few enough that they cannot crowd out the loop's own thread.
_WORKERS = 4
_executor = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="weft-api-cpu")


async def run_blocking(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` on the pool, in a copy of the caller's context variables (the
    request's trace parent, as ``asyncio.to_thread`` does); its exception (an APIError too) is
    raised here."""
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    return await loop.run_in_executor(_executor, functools.partial(context.run, fn, *args, **kwargs))
