"""Each replica's share of the requests routed lately, and a bound on it.

A policy that follows the prefix cache sends every request of a popular
prefix to the few replicas holding it.  Bounds on the *current* load (the
outstanding requests) cap the worst pile-up, but under skewed popularity the
holders of the hottest prefixes still serve far more requests than the rest
over a run.  ``RecentShare`` counts the requests routed to each replica,
exponentially decayed so that each count covers about the last ``window``
requests per replica, and marks the replicas over their share::

    count + 1 > mean + max((factor - 1) * mean, deviations * sqrt(mean)) + slack

and, mirrored, the replicas far under it::

    count < mean - max((1 - 1 / factor) * mean, deviations * sqrt(mean))

The ``sqrt`` term is chance: with every replica equally popular, counts
scatter by about ``sqrt(mean)`` (Poisson), so a replica within
``deviations`` of that is not over its share.  Without it, a fleet whose
prefixes are balanced would be scattered by noise.  The ``slack`` does the
same at start-up, where the mean is below one request and ``sqrt`` is no
guide to chance: among the first 57 requests of 64 equally popular prefixes,
one prefix drew 5 (a slack of 2 spilled the 6th to a second, idle replica,
and a prefix that first came later then found no idle replica and doubled up
with another).  The lower bound has no slack: it is below zero until the
mean passes ``deviations ** 2`` requests, and an idle replica should be
found as soon as the counts say it is idle (on 3-turn chat at 16 replicas,
where half the fleet held every session, a slack of 8 put off the first
idle replica's request from the 144th to the 354th, and histories piled up
on the busy half were lost).
"""

from __future__ import annotations

import math

import numpy as np

from kvserve.scheduler.checks import check_numbers
from kvserve.scheduler.routing.decayed_counts import DecayedCounts


class RecentShare:
    """Decayed per-replica counts of routed requests."""

    def __init__(self, factor: float, deviations: float, window: int, slack: float) -> None:
        # Named as cost_ttft's arguments, which users give.
        check_numbers(1, above=True, share_factor=factor)
        check_numbers(0, share_deviations=deviations, share_slack=slack)
        self.factor = factor
        self.deviations = deviations
        self.slack = slack
        self._requests = DecayedCounts(window, name="share_window")

    @property
    def window(self) -> int:
        return self._requests.window

    @property
    def counts(self) -> np.ndarray:
        """Each replica's decayed count of the requests routed to it."""
        return self._requests.counts

    def over_share(self, available: np.ndarray | None, num_replicas: int) -> np.ndarray:
        """Which replicas one more request would put over their share (a boolean mask).

        ``available`` (or ``None``: all) names the replicas the mean is taken over.
        """
        mean = self._mean(available, num_replicas)
        bound = mean + max((self.factor - 1.0) * mean, self.deviations * math.sqrt(mean)) + self.slack
        return self.counts + 1.0 > bound

    def under_share(self, available: np.ndarray | None, num_replicas: int) -> np.ndarray:
        """Which replicas are far under their share (a boolean mask): the mirror of ``over_share``."""
        mean = self._mean(available, num_replicas)
        bound = mean - max((1.0 - 1.0 / self.factor) * mean, self.deviations * math.sqrt(mean))
        return self.counts < bound

    def _mean(self, available: np.ndarray | None, num_replicas: int) -> float:
        """The mean count of the ``available`` replicas (``None``: all) of ``num_replicas``."""
        self._requests.resize(num_replicas)  # new replicas start with no requests (so they take the next ones)
        counts = self.counts if available is None else self.counts[available]
        return float(counts.mean())

    def record(self, replica_id: int, num_replicas: int) -> None:
        """One request was routed to ``replica_id``: decay every count, then count it."""
        self._requests.decay(num_replicas)
        self._requests.add(replica_id)
