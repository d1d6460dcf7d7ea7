"""Sending requests to the scheduler actor in batches: the front end's side of ``add_requests``.

A remote call costs both sides about a millisecond of CPU, so requests are not sent one
call each: the requests that arrive while one ``add_requests`` call is in flight go
together in the next.  ``add`` waits for its request's answer (its replica, or the
exception the scheduler refused it with).
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
    """

    def __init__(self, scheduler: Any, *, on_refused_after_leaving: Callable[[str], None]) -> None:
        self._scheduler = scheduler
        self._on_refused_after_leaving = on_refused_after_leaving
        self.sent: set[str] = set()
        self._queued: list[tuple[RequestSpec, asyncio.Future[int | None]]] = []
        self._task: asyncio.Task[None] | None = None

    async def add(self, spec: RequestSpec) -> int | None:
        """Send ``spec`` with the others that come meanwhile; its replica (``None``: it waits for one).

        The scheduler's refusal is raised.  NOTE: a caller cancelled here cancels its future: a
        request not sent yet is dropped; one in flight is the caller's to abort.
        """
        added: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        self._queued.append((spec, added))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._send_queued(), name="request-adder")
        return await added

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
            self.sent.update(spec.req_id for spec, _ in batch)
            try:
                results = await self._scheduler.add_requests.remote([spec for spec, _ in batch])
            except Exception as exc:  # noqa: BLE001 - every request of the call fails with it
                results = [exc] * len(batch)
            for (spec, added), result in zip(batch, results, strict=True):
                if added.done():
                    if isinstance(result, Exception):
                        self._on_refused_after_leaving(spec.req_id)
                    continue
                if isinstance(result, Exception):
                    added.set_exception(result)
                else:
                    added.set_result(result)
