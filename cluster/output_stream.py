"""One request's outputs on their way from the front end's dispatcher to its ``Generate`` call.

Every message on a gRPC stream costs the server and the client tens of
microseconds of CPU, whatever it carries: with a fast model, one message per
token would cost more than computing the token.  So a stream sends at most
one message per interval.  Its first tokens (time to first token) and its
end go out as soon as they arrive; the tokens that arrive less than an
interval after the previous message wait for the rest of it and travel
together::

    steps        t t t t t t t t t t t t t t t end
    messages     ^ ·······^·······^·······^·····^
                 first    every interval        end (at once)

The interval is the server's ``StreamPacing``: a minimum, grown with the
number of streams in flight so that the server sends at most its budget of
messages per second.  An interval of 0 sends whatever arrived at once (one
message per fetch of outputs).
"""

from __future__ import annotations

import asyncio
import dataclasses

from kvserve.cluster.messages import RequestDelta
from kvserve.scheduler.logprobs import TokenLogprobs


class StreamPacing:
    """The interval between two messages of a stream, shared by every stream of one server.

    ``interval_s`` is ``min_interval_s``, or ``num_streams / max_messages_per_s``
    when that is longer (``max_messages_per_s`` ``None``: no budget).
    """

    __slots__ = ("min_interval_s", "max_messages_per_s", "interval_s")

    def __init__(self, min_interval_s: float, max_messages_per_s: int | None) -> None:
        self.min_interval_s = min_interval_s
        self.max_messages_per_s = max_messages_per_s
        self.interval_s = min_interval_s

    def set_num_streams(self, num_streams: int) -> None:
        budget = self.max_messages_per_s
        self.interval_s = max(self.min_interval_s, num_streams / budget) if budget else self.min_interval_s


class OutputStream:
    """Tokens received and not yet sent, and the pacing of one request's messages.

    The dispatcher calls ``add`` and ``end``; the request's ``Generate``
    coroutine awaits ``next_message`` until it returns the last delta
    (``is_last``).  Both run on the server's event loop.
    """

    __slots__ = (
        "req_id", "_pacing", "_token_ids", "_logprobs", "_prompt_logprobs", "_replica", "_last", "_last_message_time",
        "_waiter", "_wake_on_data",
    )

    def __init__(self, req_id: str, pacing: StreamPacing) -> None:
        self.req_id = req_id
        self._pacing = pacing
        self._token_ids: list[int] = []
        # The held-back tokens' logprobs, if the request asked for them.
        self._logprobs: list[TokenLogprobs] | None = None
        # The prompt's logprobs, until the message of the first tokens (they come with them, once).
        self._prompt_logprobs: list[TokenLogprobs | None] | None = None
        self._replica: int | None = None
        self._last: RequestDelta | None = None
        self._last_message_time: float | None = None  # None until the first message
        self._waiter: asyncio.Future[None] | None = None
        self._wake_on_data = False

    def add(
        self, token_ids: list[int], replica: int, logprobs: list[TokenLogprobs] | None = None,
        prompt_logprobs: list[TokenLogprobs | None] | None = None,
    ) -> None:
        """New tokens of the running request (and their logprobs, if it asked; with its first token, its
        prompt's, if it asked)."""
        self._token_ids += token_ids
        if logprobs is not None:
            self._logprobs = logprobs if self._logprobs is None else self._logprobs + logprobs
        if prompt_logprobs is not None:
            self._prompt_logprobs = prompt_logprobs
        self._replica = replica
        if self._wake_on_data and self._waiter is not None:
            resolve_waiter(self._waiter)

    @property
    def ended(self) -> bool:
        """Whether the request's last delta came (whether or not it has gone out yet)."""
        return self._last is not None

    def end(self, delta: RequestDelta) -> None:
        """The request's last delta (``is_last``): it goes out at once, with the tokens held back."""
        self._last = delta
        if self._waiter is not None:
            resolve_waiter(self._waiter)

    async def next_message(self) -> RequestDelta:
        """The next message once it is due: the tokens since the previous one, or the last delta
        (with any tokens held back in front of its own)."""
        loop = asyncio.get_running_loop()
        interval_s = self._pacing.interval_s
        if self._last_message_time is not None and interval_s and self._last is None:
            await self._wait(loop, self._last_message_time + interval_s)
        while not self._token_ids and self._last is None:
            await self._wait(loop, None)
        token_ids, self._token_ids = self._token_ids, []
        logprobs, self._logprobs = self._logprobs, None
        prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, None
        self._last_message_time = loop.time()
        last = self._last
        if last is None:
            return RequestDelta(
                self.req_id, token_ids, replica=self._replica, logprobs=logprobs, prompt_logprobs=prompt_logprobs
            )
        if not token_ids:
            return last
        if logprobs is not None or last.logprobs is not None:
            logprobs = (logprobs or []) + (last.logprobs or [])
        return dataclasses.replace(
            last, token_ids=token_ids + last.token_ids, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else last.prompt_logprobs,
        )

    async def _wait(self, loop: asyncio.AbstractEventLoop, deadline: float | None) -> None:
        """Until ``deadline`` (``end`` wakes it early), or, for ``None``, until ``add`` or ``end``."""
        waiter = self._waiter = loop.create_future()
        self._wake_on_data = deadline is None
        timer = None if deadline is None else loop.call_at(deadline, resolve_waiter, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()


def resolve_waiter(waiter: asyncio.Future[None]) -> None:
    """Wake whoever awaits ``waiter``, unless it is already done."""
    if not waiter.done():
        waiter.set_result(None)
