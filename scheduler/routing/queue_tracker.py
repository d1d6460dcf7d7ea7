"""What the router counts of one replica's queue itself, from its scheduler's events.

Two figures of the TTFT estimate (``cost_ttft``) that the scheduler does not
need, kept here rather than in the scheduler core:

* ``num_queued_cached_tokens``: of the prompt tokens queued on the replica,
  those its prefix cache held when their request was queued (new, or again
  on preemption), looked up in the global prefix index, which mirrors the
  replica's pool exactly.  It is an estimate of what the waiting requests
  will not compute (the pool is looked up again when they are scheduled);
  like the pool's own lookup it counts full blocks, never a request's last
  token's.
* ``num_inflight_prefill_tokens``: the prompt tokens of the steps in flight
  (planned, not yet applied or discarded; more than one with async scheduling,
  ``EngineCore.steps_ahead``): no longer queued, not yet computed, and the
  steps that compute them delay every later token.

Both change in O(1) per event (a lookup walks the request's blocks once, as
the pool's does), and the router merges them into the load table whenever
the replica reports its load.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvserve.scheduler.block_hash import BlockHash, num_cacheable_blocks
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex


class StepsInFlight:
    """The prompt tokens of a replica's steps in flight, summed: steps are planned, then end
    (applied or discarded) in the order planned."""

    __slots__ = ("_steps", "num_prefill_tokens")

    def __init__(self, num_prefill_tokens: int = 0) -> None:
        self._steps: deque[int] = deque([num_prefill_tokens] if num_prefill_tokens else [])
        self.num_prefill_tokens = num_prefill_tokens

    def planned(self, num_prefill_tokens: int) -> None:
        self._steps.append(num_prefill_tokens)
        self.num_prefill_tokens += num_prefill_tokens

    def ended(self) -> None:
        if self._steps:
            self.num_prefill_tokens -= self._steps.popleft()


class QueueTracker:
    """One replica's queued cached tokens and in-flight prefill (a ``SchedulerEventObserver``)."""

    __slots__ = ("index", "replica_id", "block_size", "_cached_tokens", "_inflight", "num_queued_cached_tokens")

    def __init__(self, index: GlobalPrefixIndex, replica_id: int, block_size: int) -> None:
        self.index = index
        self.replica_id = replica_id
        self.block_size = block_size
        # Cached prompt tokens of each waiting request with any, as found when it was queued.
        self._cached_tokens: dict[str, int] = {}
        self.num_queued_cached_tokens = 0
        self._inflight = StepsInFlight()

    def request_queued(self, req_id: str, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        num_cacheable = num_cacheable_blocks(num_tokens, self.block_size)
        num_blocks = self.index.num_leading_blocks(self.replica_id, block_hashes[:num_cacheable])
        if num_blocks:
            num_cached = num_blocks * self.block_size
            self._cached_tokens[req_id] = num_cached
            self.num_queued_cached_tokens += num_cached

    def request_dequeued(self, req_id: str) -> None:
        self.num_queued_cached_tokens -= self._cached_tokens.pop(req_id, 0)

    @property
    def num_inflight_prefill_tokens(self) -> int:
        return self._inflight.num_prefill_tokens

    def step_planned(self, num_prefill_tokens: int) -> None:
        self._inflight.planned(num_prefill_tokens)

    def step_applied(self) -> None:
        self._inflight.ended()

    def mirror_inflight_prefill_tokens(self, num_prefill_tokens: int) -> None:
        """Take the in-flight figure of a tracker kept elsewhere (a simulator shard's replica),
        instead of step events."""
        self._inflight = StepsInFlight(num_prefill_tokens)

    @property
    def queued_cached_tokens(self) -> dict[str, int]:
        """Request id -> cached tokens counted for it (waiting requests with any; read it, never write it)."""
        return self._cached_tokens
