"""The knee of a baseline: the rate at which its TTFT p99 is ``factor`` x its unloaded value.

Routing experiments compare policies where the baseline (round robin) starts
to queue.  Unloaded: a short run at one request per 100 s per replica.
Then the rate doubles from one request per second per replica until the
ratio is reached, and a bisection on the log of the rate narrows it; the
measured rate whose ratio is closest to ``factor`` (on a log scale) wins.
The ratio rises steeply near saturation, so the result is "about" the knee.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from kvserve.experiments.experiment_fleet import fleet_for
from kvserve.experiments.workloads import WorkloadRequest
from kvserve.scheduler.routing.policy import RoutingPolicy
from kvserve.scheduler.simulation.simulator import FleetConfig, FleetSimulator


class KneeNotFound(ValueError):
    """The baseline's TTFT p99 did not reach the factor at any rate tried."""


def find_knee_qps(
    stream_at: Callable[[float, int], Sequence[WorkloadRequest]],
    num_requests: int,
    fleet: FleetConfig,
    make_baseline: Callable[[], RoutingPolicy],
    factor: float,
    *,
    num_unloaded_requests: int = 200,
    tolerance: float = 0.02,
    max_runs: int = 20,
    report: Callable[[str], None] = lambda line: None,
    processes: int = 1,
) -> float:
    """The rate (requests/s) at which the baseline's TTFT p99 is ``factor`` x unloaded.

    ``stream_at(qps, n)`` is the request stream at a rate with ``n`` measured
    requests.  Rates are rounded to 4 digits, so the one returned was measured.
    ``KneeNotFound`` when no rate tried (at most ``max_runs``) reached ``factor``.
    """
    if not factor > 1:
        raise ValueError(f"factor must be > 1, got {factor}")

    def ttft_p99(qps: float, n: int) -> float:
        requests = stream_at(qps, n)
        result = FleetSimulator(fleet_for(fleet, requests), make_baseline(), processes=processes).run(requests)
        return float(np.percentile([r.ttft for r in result.records if requests[r.index].measured], 99))

    unloaded_qps = 0.01 * fleet.num_replicas
    unloaded = ttft_p99(unloaded_qps, min(num_requests, num_unloaded_requests))
    report(f"knee: unloaded TTFT p99 {unloaded:.3f} s at {unloaded_qps:g} qps")
    ratios: dict[float, float] = {}

    def measure(qps: float) -> float:
        qps = float(f"{qps:.4g}")
        ratios[qps] = ttft_p99(qps, num_requests) / unloaded
        report(f"knee: {qps:g} qps -> {ratios[qps]:.2f}x")
        return ratios[qps]

    low, high = unloaded_qps, float(fleet.num_replicas)
    while measure(high) < factor and len(ratios) < max_runs:
        low, high = high, high * 2
    while high / low > 1 + tolerance and len(ratios) < max_runs:
        middle = math.sqrt(low * high)
        if measure(middle) >= factor:
            high = middle
        else:
            low = middle
    if max(ratios.values()) < factor:
        highest = max(ratios, key=ratios.__getitem__)
        # NOTE: a finite stream's TTFT stops growing once all of it arrives at
        # once; the rate at which it would reach the factor does not exist.
        raise KneeNotFound(
            f"the baseline's TTFT p99 never reached {factor:g}x its unloaded value: at most "
            f"{ratios[highest]:.2f}x (at {highest:g} qps) in {len(ratios)} runs; a longer stream "
            "(--num-requests) or a lower --knee-factor reaches it"
        )
    best = min(ratios, key=lambda qps: abs(math.log(ratios[qps] / factor)))
    report(f"knee: {best:g} qps (TTFT p99 {ratios[best]:.2f}x unloaded)")
    return best
