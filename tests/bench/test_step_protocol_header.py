"""``bench.step_protocol``'s header says how many steps a cell times, and too few steps for the rounds is a
usage error."""

from __future__ import annotations

import pytest

from kvserve.bench import step_protocol
from kvserve.bench.step_protocol import header, steps_per_round


def test_the_steps_are_shared_among_the_rounds_and_the_remainder_dropped() -> None:
    assert steps_per_round(500, 10) == 50
    assert steps_per_round(505, 10) == 50
    with pytest.raises(ValueError):
        steps_per_round(3, 10)


def test_the_header_counts_the_steps_actually_timed() -> None:
    line = header(505, 10, num_cores=2, load=0.5)
    assert "500 steps per cell: paths alternating in 10 rounds of 50" in line
    assert "505" not in line


def test_fewer_steps_than_rounds_is_a_usage_error_before_any_work(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        step_protocol.main(["--steps", "3", "--rounds", "10"])
    assert info.value.code == 2
    assert "--steps (3) must be at least --rounds (10)" in capsys.readouterr().err
