"""Each replica's decayed count of routed requests, and the bound on its share."""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.scheduler.routing.recent_share import RecentShare

NO_DECAY = 10**20  # a window so long that the decay factor rounds to 1.0: counts are exact integers


def share_with(
    counts: list[int], factor: float = 1.2, deviations: float = 0.0, window: int = NO_DECAY, slack: float = 2.0
) -> RecentShare:
    share = RecentShare(factor, deviations, window, slack)
    for replica_id, count in enumerate(counts):
        for _ in range(count):
            share.record(replica_id, len(counts))
    return share


def test_counts_decay_to_cover_about_the_last_window_requests_per_replica() -> None:
    share = RecentShare(1.2, 3.0, window=10, slack=2.0)
    share.record(0, 2)
    for _ in range(20):  # one window: 10 requests per replica x 2 replicas
        share.record(1, 2)

    assert share.counts[0] == pytest.approx((1 - 1 / 20) ** 20)  # about 1/e of a request left
    assert share.counts[1] == pytest.approx(sum((1 - 1 / 20) ** k for k in range(20)))


def test_a_replica_is_over_its_share_past_the_factor_of_the_mean_plus_two() -> None:
    # mean 25: bound 25 + 0.2 * 25 + 2 = 32; one more request must stay within it.
    assert not share_with([31, 25, 24, 20]).over_share(None, 4)[0]
    assert share_with([32, 25, 23, 20]).over_share(None, 4).tolist() == [True, False, False, False]


def test_chance_deviations_widen_the_bound_while_the_mean_is_small() -> None:
    # mean 25: 3 deviations of chance (3 * 5 = 15) exceed 20% of the mean (5): bound 42.
    assert not share_with([41, 23, 20, 16], deviations=3.0).over_share(None, 4)[0]
    assert share_with([42, 22, 20, 16], deviations=3.0).over_share(None, 4)[0]
    # mean 2500: 20% (500) exceeds 3 deviations (150): bound 3002.
    assert not share_with([3001, 2500, 2400, 2099], deviations=3.0).over_share(None, 4)[0]
    assert share_with([3002, 2500, 2400, 2098], deviations=3.0).over_share(None, 4)[0]


def test_the_slack_keeps_a_start_up_burst_within_its_share() -> None:
    # The first 57 requests of 64 equally popular prefixes, one prefix drawing 5 of them (mean 0.89).
    counts = [5] + [1] * 52 + [0] * 11
    # 5 + 1 > 0.89 + 3 * sqrt(0.89) + 2 = 5.72: a slack of 2 would spill the prefix's 6th request ...
    assert share_with(counts, deviations=3.0, slack=2.0).over_share(None, 64)[0]
    # ... a slack of 8 (the policy's default) keeps it home: bound 11.72.
    assert not share_with(counts, deviations=3.0, slack=8.0).over_share(None, 64).any()
    # 11 of 63 (mean 0.98): 11 + 1 > 0.98 + 3 * sqrt(0.98) + 8 = 11.96.
    assert share_with([11] + counts[1:], deviations=3.0, slack=8.0).over_share(None, 64).tolist() == [True] + [False] * 63


def test_a_replica_is_far_under_its_share_below_the_mirrored_bound_without_slack() -> None:
    # mean 20, factor 2: bound 20 - (1 - 1 / 2) * 20 = 10, whatever the slack.
    assert share_with([30, 30, 10, 10], factor=2.0, slack=8.0).under_share(None, 4).tolist() == [False] * 4
    assert share_with([30, 31, 10, 9], factor=2.0, slack=8.0).under_share(None, 4).tolist() == [False] * 3 + [True]
    # Chance widens it as it widens the upper bound: 3 deviations (3 * sqrt(20) = 13.4) exceed half the mean.
    assert not share_with([30, 31, 12, 7], factor=2.0, deviations=3.0).under_share(None, 4).any()
    assert share_with([30, 31, 13, 6], factor=2.0, deviations=3.0).under_share(None, 4).tolist() == [False] * 3 + [True]
    # While the mean is under deviations ** 2, no count is under it: at start-up no replica is idle.
    assert not share_with([27, 5, 0, 0], factor=2.0, deviations=3.0).under_share(None, 4).any()


def test_the_mean_is_taken_over_available_replicas_only() -> None:
    share = share_with([12, 12, 0, 0])  # mean 6 over all: bound 9.2; mean 12 over the first two: 16.4
    available = np.array([True, True, False, False])

    assert share.over_share(None, 4)[:2].all()
    assert not share.over_share(available, 4).any()


def test_new_replicas_start_empty_and_removed_ones_are_dropped() -> None:
    share = share_with([5, 3])

    assert share.over_share(None, 3).tolist() == [True, False, False]  # mean 8/3: bound 5.2
    share.record(2, 3)
    assert share.counts.tolist() == pytest.approx([5, 3, 1])
    share.record(0, 1)
    assert share.counts.tolist() == pytest.approx([6])


@pytest.mark.parametrize(
    "factor, deviations, window, slack, match",
    [
        (1.0, 3.0, 10, 2.0, "factor"),
        (1.2, -1.0, 10, 2.0, "deviations"),
        (1.2, 3.0, 0, 2.0, "window"),
        (1.2, 3.0, 2.5, 2.0, "window"),
        (1.2, 3.0, 10, -1.0, "slack"),
        (1.2, 3.0, 10, float("nan"), "slack"),
    ],
)
def test_bad_settings_are_rejected(factor: float, deviations: float, window: int, slack: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RecentShare(factor, deviations, window, slack)
