"""The ``note:`` lines of ``kvserve experiment``: what in a setup makes its figures mean less than they seem.

Each helper returns its note, or ``None`` where the setup gives no cause for one.
"""

from __future__ import annotations

from kvserve.experiments.report import count

# Fewer measured requests than this, and a run's TTFT p99 is one of its few slowest requests.
FEW_MEASURED_REQUESTS = 1_000


def trace_shortfall_note(num_requested: int | None, num_records: int, num_measured: int) -> str | None:
    """A trace of ``num_records`` records (``num_measured`` of them measured) when ``--num-requests``
    asked for ``num_requested``: a note when the trace ran out first."""
    if num_requested is None or num_records >= num_requested:
        return None
    return (
        f"note: the trace holds only {count(num_records, 'record')}, fewer than --num-requests "
        f"{num_requested:,}: all of them run, {num_measured:,} measured after a warm-up of "
        f"{num_records - num_measured:,}"
    )


def small_sample_note(num_measured: int) -> str | None:
    """A note when a run measures too few requests for its TTFT p99 to be stable."""
    if num_measured >= FEW_MEASURED_REQUESTS:
        return None
    return (
        f"note: each run measures only {count(num_measured, 'request')}: TTFT p99 is near the largest TTFT of "
        "the sample and differs from seed to seed; compare policies over "
        f"{FEW_MEASURED_REQUESTS:,} or more (--num-requests) or over several seeds (--seeds)"
    )


def one_replica_note(num_replicas: int, num_policies: int) -> str | None:
    """A note when routing policies are compared on a fleet that leaves them no choice."""
    if num_replicas != 1 or num_policies < 2:
        return None
    return (
        "note: with 1 replica routing has no choice (every policy sends every request to it): "
        "the policies' figures are the same"
    )
