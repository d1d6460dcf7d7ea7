"""One replica's load as its scheduler counts it: the snapshot a router reads
(``SchedulerLoad``, in O(1) from counters kept as requests come and go), the fuller one
for monitoring (``SchedulerStats``), how a request adds to the queued prefill, and the
queue events a scheduler reports to an observer (``SchedulerEventObserver``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvserve.scheduler.block_hash import BlockHash
from kvserve.scheduler.request import Request, RequestStatus


class SchedulerEventObserver(Protocol):
    """Receives a scheduler's queue and step events, as they happen (the router's load tracker does).

    ``request_queued``: a request joined the waiting queue, new or preempted; its
    ``block_hashes`` (those of its full blocks so far) and ``num_tokens`` are passed
    as they are at that moment.  ``request_dequeued``: a waiting request left the
    queue (admitted, aborted, or ended by a token that came after its preemption).
    ``step_planned``: ``schedule()`` planned a step with rows, with that many prompt tokens
    (rows of more than one token); ``step_applied``: the oldest such step not yet applied
    was applied by ``update()`` (or discarded: it failed).  Steps end in the order they
    were planned; with async scheduling several may be in flight.
    """

    def request_queued(self, req_id: str, block_hashes: Sequence[BlockHash], num_tokens: int) -> None: ...

    def request_dequeued(self, req_id: str) -> None: ...

    def step_planned(self, num_prefill_tokens: int) -> None: ...

    def step_applied(self) -> None: ...


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot of one replica's load and cache, for monitoring, counted by walking the
    queues: the reference that ``SchedulerLoad``'s running counters are tested against.
    (A replica's prefix-cache hit rate is its ``KVCacheManager.prefix_cache_stats``'.)"""

    num_running: int
    num_waiting: int
    num_queued_prefill_tokens: int
    kv_cache_usage: float
    num_free_blocks: int


@dataclass(frozen=True, slots=True)
class SchedulerLoad:
    """One replica's load in O(1), from counters the scheduler keeps as it goes.

    ``num_queued_prefill_tokens`` has ``get_stats``'s meaning: tokens not yet
    computed of waiting requests and of running requests still in their
    prompt.  ``num_running_tokens`` is the KV context of the running requests (their
    computed tokens): what a step's attention reads.  ``num_total_blocks``
    counts the usable blocks (the null block excluded).  What only a router
    needs (the cached part of the queue, the step in flight's prefill) it
    counts itself from ``SchedulerEventObserver`` events.
    """

    num_running: int
    num_waiting: int
    num_queued_prefill_tokens: int
    num_running_tokens: int
    num_free_blocks: int
    num_total_blocks: int


def queued_prefill_tokens(request: Request) -> int:
    """``request``'s share of ``num_queued_prefill_tokens`` as ``get_stats`` counts it."""
    if request.status is RequestStatus.RUNNING:
        if request.num_computed_tokens < request.num_prompt_tokens:
            return request.num_tokens - request.num_computed_tokens
        return 0
    return request.num_tokens - request.num_computed_tokens


def running_prefill_progress(request: Request, start: int) -> int:
    """How much a running request's queued prefill shrank when it advanced from ``start``."""
    before = request.num_tokens - start
    return before - queued_prefill_tokens(request)
