"""Requests that wait in the scheduler actor for a replica while none is available.

When every replica is down and one of them is starting again (``replica_restart``),
a new request, or one moving off a failed replica, waits here instead of failing at
once.  ``ReplicaWaitQueue`` routes the waiting requests, in the order they arrived,
as soon as a replica is back in service (``route_all``), and ends those that waited
``max_wait_s`` with an error; an abort (``pop``) or a shutdown (``end_all``) takes
them out too.  A moved request waits as it left its replica (its prompt and
the tokens it produced: a preempted request's state), so that its stream goes on
without a gap or a repeat.

Each wait is bounded, not a request's waits in all: one that waits again after its
replica failed once more (a crash loop) waits anew, and the restart's backoff,
doubling each time, soon outgrows ``max_wait_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.scheduler.request import Request

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class WaitingRequest:
    """A request waiting for a replica: why no replica took it, the replica it moved off
    (whose id its outputs carry; ``None`` for a new request), and since when (monotonic clock)."""

    request: Request
    why: str
    replica: int | None
    since: float = field(default_factory=time.monotonic)

    def waited_s(self) -> float:
        return time.monotonic() - self.since


class ReplicaWaitQueue:
    """Requests waiting for a replica (see the module docstring), by request id.

    ``route`` queues a request on a replica (its id), or raises ``ValueError`` or
    ``RuntimeError``; ``end`` ends a request that waits no more with its error.  A
    timer ends those that waited ``max_wait_s``, oldest first, while any wait.
    """

    def __init__(
        self, max_wait_s: float, *, route: Callable[[Request], int], end: Callable[[WaitingRequest, str], None]
    ) -> None:
        self.max_wait_s = max_wait_s
        self._route = route
        self._end = end
        # NOTE: in the order they began waiting, which, as all wait as long, is the order they expire in.
        self._waiting: dict[str, WaitingRequest] = {}
        self._timer: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._waiting

    def add(self, request: Request, why: str, replica: int | None = None) -> None:
        """Let ``request`` wait (``why``: why no replica took it; ``replica``: the one it moved off)."""
        if not self._waiting:
            logger.warning("no replica is available: requests wait up to %g s for one", self.max_wait_s)
        self._waiting[request.req_id] = WaitingRequest(request, why, replica)
        if self._timer is None or self._timer.done():
            self._timer = asyncio.create_task(self._expire(), name="replica-wait-timer")

    def pop(self, req_id: str) -> WaitingRequest | None:
        """``req_id``'s wait, which ends; ``None`` if it does not wait."""
        return self._waiting.pop(req_id, None)

    def route_all(self) -> None:
        """Route every waiting request, in the order they arrived (a moved one before newer ones): a
        replica is back.  One it refuses (``route`` raised) ends with the error."""
        waiting = sorted(self._waiting.values(), key=lambda entry: entry.request.arrival_time)
        self._waiting.clear()
        num_refused = 0
        for entry in waiting:
            try:
                self._route(entry.request)
            except (ValueError, RuntimeError) as exc:
                num_refused += 1
                self._end(entry, f"{entry.why}; the replica that came back refused it: {exc}")
        if waiting:
            logger.info("%d requests that waited for a replica are routed", len(waiting) - num_refused)

    def end_all(self, error: str) -> None:
        """End every waiting request with ``error``, and stop the timer (the cluster shuts down)."""
        if self._timer is not None:
            self._timer.cancel()
        waiting, self._waiting = self._waiting, {}
        for entry in waiting.values():
            self._end(entry, error)

    async def _expire(self) -> None:
        while self._waiting:
            oldest = next(iter(self._waiting.values()))
            delay_s = oldest.since + self.max_wait_s - time.monotonic()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
                continue
            expired: list[WaitingRequest] = []
            for entry in list(self._waiting.values()):
                if entry.waited_s() < self.max_wait_s:
                    break
                expired.append(self._waiting.pop(entry.request.req_id))
            logger.warning("%d requests waited %g s for a replica, and none is back: they fail", len(expired),
                           self.max_wait_s)
            for entry in expired:
                self._end(entry, f"{entry.why}; it waited {entry.waited_s():.1f} s for a replica")
