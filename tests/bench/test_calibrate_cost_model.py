"""``python -m kvserve.bench.calibrate_cost_model``: the grid flags choose the shapes timed on a real
(tiny, CPU) replica, and the fitted model is saved."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.bench.calibrate_cost_model import main
from kvserve.scheduler.simulation.cost_model import StepCostModel


def table_rows(output: str) -> list[list[str]]:
    lines = output.split("\n\n")[0].splitlines()
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if line.startswith("|")]
    return rows[2:]  # past the header and its rule


def test_grid_flags_choose_the_shapes_timed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cost.json"
    assert main(["--out", str(out), "--device", "cpu", "--threads", "1", "--prefill-lengths", "8,40",
                 "--decode-batches", "1,3", "--context-lengths", "24", "--repeats", "1"]) == 0
    printed = capsys.readouterr().out
    rows = table_rows(printed.split("\n", 1)[1])
    # (prefill tokens, decodes): two pure prefills; each decode batch alone and with the
    # longest prefill mixed in.
    assert sorted((int(r[0]), int(r[1])) for r in rows) == [(0, 1), (0, 3), (8, 0), (40, 0), (40, 1), (40, 3)]
    assert "calibrated on" in printed and "(6 steps)" in printed
    model = StepCostModel.load(out)
    assert model.a + model.b + model.c + model.d > 0


@pytest.mark.parametrize(("args", "message"), [
    (["--prefill-lengths", "16,0"], "positive integers"),
    (["--decode-batches", "a"], "positive integers"),
    (["--repeats", "2,3"], "--repeats takes one number"),
    (["--model", "m", "--shape", "llama-3-8b"], "not allowed with argument"),
    (["--shape", "llama-70b"], "invalid choice"),
])
def test_bad_flags_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "cost.json"), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "cost.json").exists()
