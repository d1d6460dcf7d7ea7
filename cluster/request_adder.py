"""Sending requests to the scheduler actor in batches: the front end's side of ``add_requests``.

A remote call costs both sides about a millisecond of CPU, so requests are not sent one
call each: the requests that arrive while one ``add_requests`` call is in flight go
together in the next.  ``add`` waits for its request's answer (its replica, or the
exception the scheduler refused it with).

Aborts of the requests added go through here too (``abort``), because they must reach the
scheduler after their add: it is an async actor, which Ray lets run an abort sent later
before the add in flight, and an abort of an id it does not know yet is ignored, so the
request would run on to its end.  An abort asked while the add is in flight is sent once
the scheduler has answered that add.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvserve.cluster.messages import RequestSpec


class RequestAdder:
    """Sends the requests ``add``ed to ``scheduler.add_requests``, those that came together in one call.

    ``sent`` holds the ids of the requests sent (in a call) whose caller has not discarded
    them.  ``on_refused_after_leaving(req_id)`` is called for a request whose caller left
    while its call was in flight and that the scheduler refused: no abort of it will come back.
    The ``abort`` given (``Frontend._abort_quietly``) sends the aborts that ``RequestAdder.abort`` asks for,
    each after its request's add has been answered.
    """

    def __init__(
        self, scheduler: Any, *, abort: Callable[[list[str]], None], on_refused_after_leaving: Callable[[str], None]
    ) -> None:
        self._scheduler = scheduler
        self._abort = abort
        self._on_refused_after_leaving = on_refused_after_leaving
        self.sent: set[str] = set()
        self._queued: list[tuple[RequestSpec, asyncio.Future[int | None]]] = []
        self._task: asyncio.Task[None] | None = None
        # The ids of the call in flight, and those of them to abort once it is answered.
        self._in_flight: set[str] = set()
        self._abort_when_answered: set[str] = set()

    async def add(self, spec: RequestSpec) -> int | None:
        """Send ``spec`` with the others that come meanwhile; its replica (``None``: it waits for one).

        The scheduler's refusal is raised.  NOTE: a caller cancelled here cancels its future: a
        request not sent yet is dropped; one in flight is the caller's to abort (``abort``).
        """
        added: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        self._queued.append((spec, added))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._send_queued(), name="request-adder")
        return await added

    def abort(self, req_ids: list[str]) -> None:
        """Abort ``req_ids`` (requests ``add``ed, or never sent): at once, but those of the call in flight
        once the scheduler has answered it, those it took (see the module docstring)."""
        self._abort_when_answered.update(req_id for req_id in req_ids if req_id in self._in_flight)
        now = [req_id for req_id in req_ids if req_id not in self._in_flight]
        if now:
            self._abort(now)

    async def stop(self) -> None:
        """Stop sending (the front end stops)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _send_queued(self) -> None:
        """Send the queued requests: all that came while the previous call was in flight go in one."""
        while self._queued:
            batch = [(spec, added) for spec, added in self._queued if not added.done()]
            self._queued = []
            if not batch:
                continue
            req_ids = [spec.req_id for spec, _ in batch]
            self.sent.update(req_ids)
            self._in_flight.update(req_ids)
            try:
                results = await self._scheduler.add_requests.remote([spec for spec, _ in batch])
            except Exception as exc:  # noqa: BLE001 - every request of the call fails with it
                results = [exc] * len(batch)
            except asyncio.CancelledError:  # stopped: no answer will come, the aborts asked for go now
                self._in_flight.clear()
                self._send_aborts_asked([req_id for req_id in req_ids if req_id in self._abort_when_answered])
                raise
            self._in_flight.clear()
            to_abort = []
            for (spec, added), result in zip(batch, results, strict=True):
                refused = isinstance(result, Exception)
                if not refused and spec.req_id in self._abort_when_answered:
                    to_abort.append(spec.req_id)
                if added.done():  # its caller left while the call was in flight
                    if refused:
                        self._on_refused_after_leaving(spec.req_id)
                elif refused:
                    added.set_exception(result)
                else:
                    added.set_result(result)
            self._send_aborts_asked(to_abort)

    def _send_aborts_asked(self, req_ids: list[str]) -> None:
        """The aborts asked for while the call in flight was (``req_ids``: of the requests it may have added)."""
        self._abort_when_answered.clear()
        if req_ids:
            self._abort(req_ids)
