"""The scheduler's waiting queue, in three orders: arrival (fcfs), priority,
or shortest-first.

Arrival means the engine's own: ``Request.arrival_order`` (a counter) and
``Request.arrival_s`` (its monotonic clock), never the wire's wall-clock
``arrival_time``, which a clock stepped back would turn against the queue.

All share one small interface so the scheduler never branches on policy
except when it picks a preemption victim.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from services.engine_core.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a newly arrived request."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the request to schedule next."""

    @abstractmethod
    def peek(self) -> Request:
        """Return the request to schedule next without removing it."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Queue a preempted request so it runs again as soon as possible."""

    @abstractmethod
    def requeue(self, request: Request) -> None:
        """Queue again a request that waited off the queue (grammar compiling,
        remote KV loading): among those queued by ``add`` and ``requeue`` it
        keeps its arrival order, so it goes ahead of every later arrival."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Drop one queued request (an abort); ValueError if it is absent."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Drop those of ``requests`` that are queued, in one pass."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in the order they would be popped."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def pop(self) -> Request:
        return self._queue.popleft()

    def peek(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty request queue")
        return self._queue[0]

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def requeue(self, request: Request) -> None:
        # Before the first request that arrived after it (preempted ones at the
        # front stay there: they arrived earlier, having already run).
        for index, queued in enumerate(self._queue):
            if queued.arrival_order > request.arrival_order:
                self._queue.insert(index, request)
                return
        self._queue.append(request)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        # One pass instead of one O(n) deque.remove per request.
        drop = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in drop)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """A heap on (priority, arrival order, request_id): smaller value first.

    The request id is unique, so the heap never compares Request objects.
    A preempted request keeps its key, so ``prepend`` is a plain push: it
    still comes out ahead of anything that arrived after it.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, Request]] = []

    @staticmethod
    def _entry(request: Request) -> tuple[float, int, str, Request]:
        return (request.priority, request.arrival_order, request.request_id, request)

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, self._entry(request))

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def peek(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty request queue")
        return self._heap[0][-1]

    def prepend(self, request: Request) -> None:
        self.add(request)

    def requeue(self, request: Request) -> None:
        self.add(request)  # its key holds its arrival order

    def remove(self, request: Request) -> None:
        size = len(self._heap)
        self.remove_requests((request,))
        if len(self._heap) == size:
            raise ValueError(f"{request.request_id!r} is not in the queue")

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {r.request_id for r in requests}
        self._heap = [e for e in self._heap if e[2] not in drop]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap))


# Shortest-first counts a prompt token as this many seconds of waiting: about
# what a token of prefill costs on two CPU cores (1,000-1,700 tokens/s here).
SECONDS_PER_PROMPT_TOKEN = 0.001


class ShortestFirstRequestQueue(PriorityRequestQueue):
    """Shortest prompt first, with a bounded head start: the key is
    ``arrival_s + num_prompt_tokens * SECONDS_PER_PROMPT_TOKEN`` (the engine's
    monotonic clock), when the request's prefill would end had it run alone
    from its arrival.

    Requests that arrive together (a burst) run shortest first, which brings
    the median time to first token down to that of the shorter half of the
    prompts. A prompt of n tokens can be passed only by requests that arrived
    less than (n - m) ms after it (m: their length), so it is never starved:
    once it has waited n ms every later arrival queues behind it. Priority
    values are not looked at (that is the priority policy's order).
    """

    @staticmethod
    def _entry(request: Request) -> tuple[float, int, str, Request]:
        finish = request.arrival_s + request.num_prompt_tokens * SECONDS_PER_PROMPT_TOKEN
        return (finish, request.arrival_order, request.request_id, request)


_POLICIES: dict[str, type[RequestQueue]] = {
    "fcfs": FCFSRequestQueue,
    "priority": PriorityRequestQueue,
    "shortest-first": ShortestFirstRequestQueue,
}


def create_request_queue(policy: str) -> RequestQueue:
    try:
        return _POLICIES[policy]()
    except KeyError:
        raise ValueError(f"scheduling policy must be one of {sorted(_POLICIES)}, got {policy!r}.") from None
