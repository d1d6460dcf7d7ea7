"""What the scheduler actor's steps produced for the front end, until its next poll.

``PendingOutput`` is what one request produced since the front end last polled.
``OutputMailbox`` holds them by request and hands them, all at once, to the
poll that takes them: one remote call per batch of steps, never per token.

There is one consumer, the front end: two pollers would split the outputs
between them.  A poll whose caller went away (a front end that stopped or died
while its poll waited) must not take them either, so only the newest poll
does; an older one that wakes finds itself superseded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

from kvserve.cluster.messages import RequestDelta
from kvserve.scheduler.logprobs import TokenLogprobs
from kvserve.scheduler.prompt_logprobs import first_output_prompt_logprobs
from kvserve.scheduler.request import Request
from kvserve.scheduler.request_output import RequestOutput


@dataclass(slots=True)
class PendingOutput:
    """What one request produced since the front end last polled: its new tokens (and their
    logprobs, if it asked), its prompt's logprobs with its first token (if it asked), and its end."""

    # None for a request no replica took (it waited for one in vain: ``replica_wait_queue``).
    replica: int | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # The request's last delta once it ended, without its tokens.
    end: RequestDelta | None = None

    def add(self, output: RequestOutput, request: Request) -> None:
        """``output``, a step's token of ``request`` (its ``Request``, already updated with it), and its end if
        it was the last.

        The prompt's logprobs go with the request's first output token, and with no other: a request moved
        off a failed replica keeps the tokens it produced there (``SchedulerActor._resumed``), so its next
        token is not its first.
        """
        self.token_ids.append(output.token_id)
        if output.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.append(output.logprobs)
        # NOTE: complete once the first output token exists (kvserve.scheduler.prompt_logprobs).
        if request.prompt_logprobs is not None and len(request.output_token_ids) == 1:
            self.prompt_logprobs = first_output_prompt_logprobs(request)
        if output.finish_reason is not None:
            self.finish(request, reason=output.finish_reason.value)

    def finish(self, request: Request, *, reason: str | None = None, error: str | None = None) -> None:
        self.end = RequestDelta(
            req_id=request.req_id,
            finish_reason=reason,
            error=error,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_output_tokens=request.num_output_tokens,
            replica=self.replica,
        )

    def to_delta(self, req_id: str) -> RequestDelta:
        if self.end is None:
            return RequestDelta(
                req_id, self.token_ids, replica=self.replica, logprobs=self.logprobs,
                prompt_logprobs=self.prompt_logprobs,
            )
        return dataclasses.replace(
            self.end, token_ids=self.token_ids, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs
        )


class OutputMailbox:
    """The outputs of every request since the last poll, by request id (see the module docstring)."""

    def __init__(self) -> None:
        self.pending: dict[str, PendingOutput] = {}
        self._ready = asyncio.Event()
        self._num_waiting_polls = 0
        self._num_polls = 0
        self._last_poll_time = time.monotonic()

    def entry(self, req_id: str, replica_id: int | None) -> PendingOutput:
        """``req_id``'s pending output, new (from ``replica_id``) if it had none."""
        entry = self.pending.get(req_id)
        if entry is None:
            entry = self.pending[req_id] = PendingOutput(replica_id)
        return entry

    def notify(self) -> None:
        """Wake the waiting poll: outputs were added."""
        self._ready.set()

    async def take(self, timeout_s: float) -> dict[str, PendingOutput] | None:
        """Every pending output, after waiting up to ``timeout_s`` for one if there was none;
        ``None`` if a newer poll came meanwhile (it takes them)."""
        self._num_waiting_polls += 1
        self._num_polls += 1
        poll = self._num_polls
        try:
            if not self.pending and timeout_s > 0:
                self._ready.clear()
                try:
                    await asyncio.wait_for(self._ready.wait(), timeout_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._num_waiting_polls -= 1
            self._last_poll_time = time.monotonic()
        if poll != self._num_polls:
            return None
        pending, self.pending = self.pending, {}
        return pending

    def unfetched_s(self) -> float:
        """How long outputs have waited with no poll waiting for them (0 if none wait, or a poll does)."""
        if not self.pending or self._num_waiting_polls:
            return 0.0
        return time.monotonic() - self._last_poll_time
