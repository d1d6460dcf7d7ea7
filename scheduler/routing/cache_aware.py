"""SGLang's cache-aware router: the longest prefix match unless the load is skewed.

When the fleet is imbalanced on BOTH counts (max - min outstanding requests
above ``balance_abs_threshold`` and max above ``balance_rel_threshold`` x
min), the request goes to the least loaded replica.  Otherwise it goes to the
replica caching the longest prefix of its prompt, if that covers at least
``cache_threshold`` of the prompt's tokens, else to the least loaded.
Unavailable replicas count for nothing: neither loads nor matches.

Where this differs from SGLang's router, it follows kvserve's specification
of the policy: the match is the exact global index (SGLang approximates
caches with a radix tree of the requests it routed); a match of exactly
the threshold counts (SGLang: more than it); and without one the request
goes to the least loaded replica (SGLang: the one whose tree is smallest).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.scheduler.checks import check_numbers
from kvserve.scheduler.routing.load import LoadTable, ReplicaLoad
from kvserve.scheduler.routing.policy import RoutingRequest
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex


class CacheAwarePolicy:
    """SGLang's thresholds (defaults from its router: 64 requests, 1.5x, 0.3)."""

    name = "cache_aware"

    def __init__(
        self,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        cache_threshold: float = 0.3,
    ) -> None:
        check_numbers(0, balance_abs_threshold=balance_abs_threshold)
        check_numbers(0, maximum=1, cache_threshold=cache_threshold)
        check_numbers(1, balance_rel_threshold=balance_rel_threshold)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cache_threshold = cache_threshold

    def select(
        self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: GlobalPrefixIndex
    ) -> int:
        table = LoadTable.of(replicas)
        outstanding = table.num_outstanding
        if table.all_available:
            least_loaded = int(outstanding.argmin())
            max_load = int(outstanding.max())
        else:
            available_ids = table.available_ids()
            available_outstanding = outstanding[available_ids]
            least_loaded = int(available_ids[available_outstanding.argmin()])
            max_load = int(available_outstanding.max())
        min_load = int(outstanding[least_loaded])
        if (
            max_load - min_load > self.balance_abs_threshold
            and max_load > self.balance_rel_threshold * min_load
        ):
            return least_loaded
        matches = index.match(request.block_hashes)
        if not table.all_available:
            available = table.available
            matches = {replica_id: n for replica_id, n in matches.items() if available[replica_id]}
        if not matches:
            return least_loaded
        # The longest match; among equals, the least loaded, then the lowest id.
        best = min(matches, key=lambda r: (-matches[r], outstanding[r], r))
        # NOTE: less a rounding error, so that exactly the threshold counts (0.07 * 100 is 7.000000000000001).
        if request.cached_tokens(matches[best]) >= self.cache_threshold * request.num_prompt_tokens - 1e-9:
            return best
        return least_loaded
