"""Least loaded by the power of two choices: blind to caches, O(1) per request."""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvserve.scheduler.checks import check_ints
from kvserve.scheduler.routing.load import LoadTable, ReplicaLoad
from kvserve.scheduler.routing.policy import RoutingRequest
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex


class LeastLoadedPolicy:
    """Sample two distinct available replicas (seeded), send to the less loaded.

    Load is outstanding requests (running + waiting), ties broken by queued
    prefill tokens, then by the first sampled.  Two random choices keep the
    maximum load within O(log log n) of the mean without reading every replica.
    """

    name = "least_loaded"

    def __init__(self, seed: int = 0) -> None:
        check_ints(0, seed=seed)
        self._rng = random.Random(seed)

    def select(
        self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: GlobalPrefixIndex
    ) -> int:
        table = LoadTable.of(replicas)
        candidates = None if table.all_available else table.available_ids()
        num_candidates = len(table) if candidates is None else len(candidates)
        if num_candidates == 1:
            return 0 if candidates is None else int(candidates[0])
        first = self._rng.randrange(num_candidates)
        second = self._rng.randrange(num_candidates - 1)
        if second >= first:
            second += 1
        if candidates is not None:
            first, second = int(candidates[first]), int(candidates[second])
        outstanding = table.num_outstanding
        queued = table.num_queued_prefill_tokens
        if (outstanding[second], queued[second]) < (outstanding[first], queued[first]):
            return second
        return first
