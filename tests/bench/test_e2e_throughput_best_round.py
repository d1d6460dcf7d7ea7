"""``bench.e2e_throughput``: the messages per stream come from the round whose time is shown, and a bad
``--model`` is a usage error."""

from __future__ import annotations

import pytest

from kvserve.bench import e2e_throughput
from kvserve.bench.e2e_throughput import best_round


def test_the_best_round_keeps_its_own_messages() -> None:
    rounds = [(2.0, 1.5, [9, 9]), (1.0, 1.2, [4, 6]), (3.0, 0.9, [1, 1])]  # the last round is not the best
    assert best_round(rounds) == (1.0, 1.2, [4, 6])


def test_a_model_that_is_not_a_directory_is_a_usage_error_naming_the_flag(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        e2e_throughput.main(["--model", "/nonexistent/model"])
    assert info.value.code == 2
    assert "argument --model: '/nonexistent/model' is not a model directory" in capsys.readouterr().err
