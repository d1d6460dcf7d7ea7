"""Arrival times: Poisson, or bursty (a gamma renewal process), at a mean rate.

``burstiness`` is the gamma shape, as in vLLM's serving benchmark: 1 gives a
Poisson process, smaller values bursts (inter-arrival CV = 1/sqrt(burstiness)),
larger values more regular arrivals.  The mean rate is ``qps`` either way.
"""

from __future__ import annotations

import numpy as np


def check_rate(qps: float, burstiness: float) -> None:
    if not qps > 0 or not np.isfinite(qps):
        raise ValueError(f"qps must be a positive number, got {qps}")
    if not burstiness > 0 or not np.isfinite(burstiness):
        raise ValueError(f"burstiness must be a positive number, got {burstiness}")


def arrival_times(num_requests: int, qps: float, rng: np.random.Generator, burstiness: float = 1.0) -> np.ndarray:
    """``num_requests`` increasing arrival times (seconds) at mean rate ``qps``."""
    check_rate(qps, burstiness)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (qps * burstiness), size=num_requests)
    return np.cumsum(gaps)


def zipf_probabilities(num_items: int, exponent: float) -> np.ndarray:
    """Popularity of items ``0..n-1`` proportional to ``1 / (rank + 1) ** exponent`` (0: uniform)."""
    if num_items < 1:
        raise ValueError(f"need at least one item, got {num_items}")
    if exponent < 0:
        raise ValueError(f"the Zipf exponent must be >= 0, got {exponent}")
    weights = 1.0 / np.arange(1, num_items + 1, dtype=np.float64) ** exponent
    return weights / weights.sum()
