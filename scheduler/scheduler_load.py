"""One replica's load as its scheduler counts it: the snapshot a router reads
(``SchedulerLoad``, in O(1) from counters kept as requests come and go), the fuller one
for monitoring (``SchedulerStats``), and how a request adds to the queued prefill."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.scheduler.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot of one replica's load and cache, for routing and monitoring."""

    num_running: int
    num_waiting: int
    num_queued_prefill_tokens: int
    kv_cache_usage: float
    num_free_blocks: int
    prefix_cache_hit_rate: float


@dataclass(frozen=True, slots=True)
class SchedulerLoad:
    """One replica's load in O(1), from counters the scheduler keeps as it goes.

    ``num_queued_prefill_tokens`` has ``get_stats``'s meaning: tokens not yet
    computed of waiting requests and of running requests still in their
    prompt.  ``num_queued_cached_tokens`` is the part of it the prefix cache
    held when the waiting requests were queued (an estimate of what they will
    not compute: they are looked up again when scheduled).
    ``num_running_tokens`` is the KV context of the running requests (their
    computed tokens): what a step's attention reads.  ``num_total_blocks``
    counts the usable blocks (the null block excluded).
    ``num_inflight_prefill_tokens`` are the prompt tokens of the
    step in flight (scheduled, not yet updated): no longer queued, not yet
    computed, and the step that computes them delays every later token.
    """

    num_running: int
    num_waiting: int
    num_queued_prefill_tokens: int
    num_running_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    num_queued_cached_tokens: int = 0
    num_inflight_prefill_tokens: int = 0



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
