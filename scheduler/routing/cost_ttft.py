"""Cost-based routing: the replica with the lowest estimated time to first token.

For each replica the estimate prices, with the step cost model, the prefill
work ahead of the request's first token there: the replica's queued prefill
tokens (less those its prefix cache held when they were queued: waiting
requests will not compute them) plus the request's own uncached tokens (its
prompt minus that replica's prefix match).  The replica computes that work
in steps of at most ``max_num_batched_tokens`` tokens, less one per running
decode, and each step also pays the fixed cost and its running decodes::

    work    = queued uncached prefill tokens + uncached prompt tokens
    steps   = ceil(work / (budget - running))
    ttft    = steps * (a + c * running + d * running context) + b * work

Replicas that match nothing share one vectorised estimate; only the few that
match are priced one by one.

Estimates closer to the best than ``tie_tolerance_steps`` steps of the best
replica are ties, and ties go to the replica with the fewest outstanding
requests (then the lowest estimate, then the lowest id).  NOTE: the estimate
cannot see how far the replica's step in flight has gone, so differences
within a step are noise; and a TTFT estimate alone barely feels a replica's
decode batch (it pays one step of it), so without this rule a small cached
prefix (a system prompt) held by a few busy replicas would keep every new
session away from idle ones.

``load_factor``, when set, also excludes replicas whose outstanding requests
would exceed ``ceil(load_factor * mean)`` (bounded loads, as in consistent
hashing with bounded loads): it evens out skewed popularity at the price of
prefix hits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kvserve.scheduler.routing.load import LoadTable, ReplicaLoad
from kvserve.scheduler.routing.policy import RoutingRequest
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex
from kvserve.scheduler.simulation.cost_model import StepCostModel


class CostTTFTPolicy:
    """Lowest estimated TTFT under the step cost model, near-ties to the least loaded."""

    name = "cost_ttft"

    def __init__(
        self,
        cost_model: StepCostModel | None = None,
        max_num_batched_tokens: int = 2048,
        tie_tolerance_steps: float = 1.0,
        load_factor: float | None = None,
    ) -> None:
        if max_num_batched_tokens < 2:
            raise ValueError(f"max_num_batched_tokens must be >= 2, got {max_num_batched_tokens}")
        if tie_tolerance_steps < 0:
            raise ValueError(f"tie_tolerance_steps must be >= 0, got {tie_tolerance_steps}")
        if load_factor is not None and not load_factor > 1.0:
            raise ValueError(f"load_factor must be > 1 (or None), got {load_factor}")
        self.cost_model = cost_model or StepCostModel.default()
        self.max_num_batched_tokens = max_num_batched_tokens
        self.tie_tolerance_steps = tie_tolerance_steps
        self.load_factor = load_factor

    def estimate_ttft(
        self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: GlobalPrefixIndex
    ) -> np.ndarray:
        """Estimated seconds to ``request``'s first token on each replica."""
        table = LoadTable.of(replicas)
        model = self.cost_model
        per_step = self._step_time(table)
        prefill_budget = np.maximum(self.max_num_batched_tokens - table.num_running, 1)
        queued = table.num_queued_prefill_tokens - table.num_queued_cached_tokens
        work = queued + request.num_prompt_tokens
        ttft = np.ceil(work / prefill_budget) * per_step + model.b * work
        for replica_id, num_blocks in index.match(request.block_hashes).items():
            replica_work = work[replica_id] - request.cached_tokens(num_blocks)
            ttft[replica_id] = (
                -(-replica_work // prefill_budget[replica_id]) * per_step[replica_id]
                + model.b * replica_work
            )
        return ttft

    def select(
        self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: GlobalPrefixIndex
    ) -> int:
        table = LoadTable.of(replicas)
        ttft = self.estimate_ttft(request, table, index)
        outstanding = table.num_outstanding
        if self.load_factor is not None:
            bound = math.ceil(self.load_factor * (table.total_outstanding + 1) / len(table))
            ttft[outstanding + 1 > bound] = np.inf
        best = int(ttft.argmin())
        tolerance = self.tie_tolerance_steps * float(self._step_time(table)[best]) + 1e-12
        ties = np.flatnonzero(ttft <= ttft[best] + tolerance)
        if len(ties) > 1:
            # Fewest outstanding requests first, then the lowest estimate (lexsort: last key first).
            best = int(ties[np.lexsort((ttft[ties], outstanding[ties]))[0]])
        return best

    def _step_time(self, table: LoadTable) -> np.ndarray:
        """Seconds of one step of each replica with its running decodes (no prefill)."""
        model = self.cost_model
        return model.a + model.c * table.num_running + model.d * table.num_running_tokens
