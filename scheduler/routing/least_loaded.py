"""Least loaded by the power of two choices: blind to caches, O(1) per request."""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvserve.scheduler.routing.load import LoadTable, ReplicaLoad
from kvserve.scheduler.routing.policy import RoutingRequest
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex


class LeastLoadedPolicy:
    """Sample two distinct replicas (seeded), send to the less loaded.

    Load is outstanding requests (running + waiting), ties broken by queued
    prefill tokens, then by the first sampled.  Two random choices keep the
    maximum load within O(log log n) of the mean without reading every replica.
    """

    name = "least_loaded"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def select(
        self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: GlobalPrefixIndex
    ) -> int:
        table = LoadTable.of(replicas)
        num_replicas = len(table)
        if num_replicas == 1:
            return 0
        first = self._rng.randrange(num_replicas)
        second = self._rng.randrange(num_replicas - 1)
        if second >= first:
            second += 1
        outstanding = table.num_outstanding
        queued = table.num_queued_prefill_tokens
        if (outstanding[second], queued[second]) < (outstanding[first], queued[first]):
            return second
        return first
