"""The front end's ``poll_outputs`` calls to the scheduler actor, one at a time, and their end.

Cancelling the task that awaits a Ray call does not cancel the call: a front end
that stopped left its poll waiting in the actor, which handed the next outputs
to a caller that was gone (the first tokens of the requests of the front end
started next on the cluster).  ``end`` therefore cancels the call in the actor
(``ray.cancel`` interrupts the waiting poll) and returns what it had taken, if
it had, for the stopping front end to route.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from kvserve.cluster.messages import OutputBatch

logger = logging.getLogger(__name__)

POLL_TIMEOUT_S = 1.0
# How long ``end`` waits for the cancelled poll to end (it ends by itself after POLL_TIMEOUT_S).
_END_TIMEOUT_S = POLL_TIMEOUT_S + 1.0


class OutputPoll:
    """Polls ``scheduler`` (the actor's handle, or a stand-in whose calls are awaitables) for outputs."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler
        # The call in flight (a Ray ObjectRef), until it returns: still set if its awaiting task was cancelled.
        self._call: Any | None = None

    async def next(self) -> OutputBatch:
        """The outputs of every request since the last poll, waiting up to ``POLL_TIMEOUT_S`` for one;
        raises what the remote call raises."""
        call = self._call = self._scheduler.poll_outputs.remote(POLL_TIMEOUT_S)
        try:
            batch = await call
        except asyncio.CancelledError:
            raise  # the call goes on in the actor: end() ends it
        except BaseException:
            self._call = None
            raise
        self._call = None
        return batch

    async def end(self) -> OutputBatch | None:
        """End the call left in flight by a cancelled ``next``; the outputs it had taken, if any."""
        call, self._call = self._call, None
        if call is None:
            return None
        if isinstance(call, ray.ObjectRef):
            ray.cancel(call)
        else:  # an awaitable that is not a Ray call (a stand-in for the actor): cancel it itself
            call.cancel()
        ending = asyncio.ensure_future(call)
        await asyncio.wait({ending}, timeout=_END_TIMEOUT_S)
        if not ending.done():
            ending.cancel()
            logger.warning("the last poll of the stopped front end did not end in %.1f s", _END_TIMEOUT_S)
            return None
        if ending.cancelled() or ending.exception() is not None:
            return None
        # It had taken its outputs before the cancel came.
        return ending.result()
