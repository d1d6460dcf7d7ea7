"""``python -m kvserve.bench.calibrate_cost_model``: the grid flags choose the shapes timed on a real
(tiny, CPU) replica, and the fitted model is saved."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.bench.calibrate_cost_model import main
from kvserve.scheduler.cost_model import StepCostModel


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
    assert "calibrated on a tiny Llama (6 step shapes)" in printed
    model = StepCostModel.load(out)
    assert model.a + model.b + model.c + model.d > 0


@pytest.mark.parametrize(("args", "message"), [
    (["--prefill-lengths", "16,0"], "comma-separated integers >= 1"),
    (["--decode-batches", "a"], "comma-separated integers >= 1"),
    (["--repeats", "2,3"], "expected an integer >= 1, got '2,3'"),
    (["--repeats", "0"], "expected an integer >= 1, got '0'"),
    (["--threads", "0"], "expected an integer >= 1"),
    (["--block-size", "-3"], "expected an integer >= 1"),
    # 1 pure prefill + 1 decode + 1 mixed shape: the fit failed after the whole run.
    (["--prefill-lengths", "64", "--decode-batches", "1", "--context-lengths", "16"],
     "the grid gives 3 step shapes and fitting 4 coefficients needs 4"),
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


@pytest.mark.parametrize("out", ["missing/cost.json", "."])
def test_an_unwritable_out_is_refused_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], out: str
) -> None:
    # It failed at the end, after the model had been written and timed.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", out, "--device", "cpu", "--quick"])
    assert exit_info.value.code == 2
    assert f"--out {out}: not a file in an existing directory" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_grid_past_the_models_length_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The tiny Llama serves 2048 tokens; 4096-token prefills were timed past it.
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "cost.json"), "--device", "cpu", "--threads", "1",
              "--prefill-lengths", "16,4096", "--decode-batches", "1,2", "--context-lengths", "16"])
    assert exit_info.value.code == 2
    assert "the grid's sequences reach 4098 tokens and the model serves at most 2048" in capsys.readouterr().err
