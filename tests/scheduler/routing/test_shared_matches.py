"""SharedMatches: a match is shared when another recent request's match ended at the same block."""

from __future__ import annotations

import pytest

from kvserve.scheduler.routing.shared_matches import SharedMatches


def test_a_match_is_shared_when_another_ended_at_its_block_within_the_window() -> None:
    matches = SharedMatches(window=3)

    assert matches.observe(b"system") is False  # the first to end there
    assert matches.observe(b"history-1") is False
    assert matches.observe(b"system") is True  # 2 requests after the first
    assert [matches.observe(block) for block in (b"a", b"b", b"c")] == [False, False, False]
    assert matches.observe(b"system") is False  # 4 requests after the last: too long ago


def test_a_session_whose_matches_end_further_each_turn_is_never_shared() -> None:
    matches = SharedMatches(window=100)

    assert not any(matches.observe(f"turn-{turn}".encode()) for turn in range(50))


def test_memory_stays_within_twice_the_window() -> None:
    matches = SharedMatches(window=10)

    for i in range(1000):
        matches.observe(i.to_bytes(8, "little"))
        assert len(matches) <= 21
    # Forgetting drops only blocks seen more than a window ago.
    assert matches.observe((995).to_bytes(8, "little")) is True


@pytest.mark.parametrize("window", [0, -1, 2.5, True, None])
def test_rejects_a_window_that_is_not_a_positive_integer(window: object) -> None:
    with pytest.raises(ValueError, match="shared_match_window"):
        SharedMatches(window, name="shared_match_window")  # type: ignore[arg-type]
