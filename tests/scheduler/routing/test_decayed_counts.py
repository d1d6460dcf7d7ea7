"""Per-replica counts that fade over about the last ``window`` requests per replica."""

from __future__ import annotations

import pytest

from kvserve.scheduler.routing.decayed_counts import DecayedCounts


def test_a_count_fades_to_about_one_over_e_after_window_requests_per_replica() -> None:
    counts = DecayedCounts(10)
    counts.decay(2)
    counts.add(0)
    for _ in range(20):  # one window: 10 requests per replica x 2 replicas
        counts.decay(2)

    assert counts.counts[0] == pytest.approx((1 - 1 / 20) ** 20)
    assert counts.counts[1] == 0.0


def test_new_replicas_start_at_zero_and_removed_ones_are_dropped() -> None:
    counts = DecayedCounts(10**20)  # no decay to speak of: exact counts
    counts.resize(2)
    counts.add(0)
    counts.add(1)
    counts.add(1)
    counts.decay(3)

    assert counts.counts.tolist() == [1.0, 2.0, 0.0]
    counts.resize(1)
    assert counts.counts.tolist() == [1.0]


@pytest.mark.parametrize("window", [0, -1, 2.5, True])
def test_a_window_that_is_not_a_positive_integer_is_refused_under_its_users_name(window: object) -> None:
    with pytest.raises(ValueError, match="home_window"):
        DecayedCounts(window, name="home_window")  # type: ignore[arg-type]
