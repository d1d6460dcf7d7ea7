"""Per-replica counts that fade, so that each covers about the last ``window`` requests per replica.

At every routed request each count is multiplied by ``1 - 1 / (window *
replicas)``: after ``window`` requests per replica, what a count held
before is down to about 1/e.  The routing policies use it for their
recent history (``RecentShare``'s requests per replica, ``cost_ttft``'s
new prompts per replica) without keeping the requests themselves.
"""

from __future__ import annotations

import numpy as np

from kvserve.scheduler.checks import check_ints


class DecayedCounts:
    """One decayed count per replica; ``counts[r]`` is replica ``r``'s."""

    def __init__(self, window: int, *, name: str = "window") -> None:
        """``name``: the argument ``window`` is reported as when invalid (the user's name for it)."""
        check_ints(1, **{name: window})
        self.window = window
        self.counts = np.zeros(0)

    def decay(self, num_replicas: int) -> None:
        """One request was routed among ``num_replicas`` replicas: every count fades by one step."""
        self.resize(num_replicas)
        self.counts *= 1.0 - 1.0 / (self.window * num_replicas)

    def add(self, replica_id: int) -> None:
        """Count one for ``replica_id`` (after ``decay`` or ``resize`` for the current fleet)."""
        self.counts[replica_id] += 1.0

    def resize(self, num_replicas: int) -> None:
        """New replicas start at zero; removed ones (the highest ids) are dropped."""
        if len(self.counts) != num_replicas:
            counts = np.zeros(num_replicas)
            keep = min(num_replicas, len(self.counts))
            counts[:keep] = self.counts[:keep]
            self.counts = counts
