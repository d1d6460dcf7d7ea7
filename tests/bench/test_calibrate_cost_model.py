"""``python -m kvserve.bench.calibrate_cost_model``: the grid flags choose the shapes timed on a real
(tiny, CPU) replica, and the fitted model is saved."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvserve.bench import calibrate_cost_model
from kvserve.bench.arg_types import unwritable_reason
from kvserve.bench.calibrate_cost_model import main
from kvserve.scheduler.cost_model import StepCostModel, StepSample, StepShape


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
    # What was timed travels with the coefficients.
    about = json.loads(out.read_text())["calibration"]
    assert (about["timed"], about["device"], about["dtype"], about["torch_threads"], about["step_shapes"]) == (
        "a tiny Llama", "cpu", "float32", 1, 6
    )
    assert about["block_size"] == 16 and 0 <= about["mean_relative_error"] and about["date"].endswith("+00:00")


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
    (["--model", "MODEL_DIR", "--shape", "llama-3-8b"], "not allowed with argument"),
    (["--model", "missing"], "argument --model: 'missing' is not a model directory: no such directory"),
    (["--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'"),
    (["--shape", "llama-70b"], "invalid choice"),
])
def test_bad_flags_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    from kvserve.worker.tiny_model import tiny_config

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    config = tiny_config("llama")
    config.architectures = ["LlamaForCausalLM"]
    config.to_json_file(model_dir / "config.json")  # a config kvserve runs, no weights
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path / "cost.json"), *[str(model_dir) if a == "MODEL_DIR" else a for a in args]])
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


def test_an_out_that_cannot_be_created_is_refused_before_any_work(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # /proc passed the directory check; the save failed after the whole calibration.
    monkeypatch.setattr(calibrate_cost_model, "model_dir_for", lambda *args: pytest.fail("a model was written"))
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", "/proc/kvserve-cost.json", "--device", "cpu", "--quick"])
    assert exit_info.value.code == 2
    assert "--out /proc/kvserve-cost.json: No such file or directory" in capsys.readouterr().err


def test_checking_an_out_leaves_no_new_file_and_an_old_one_as_it_was(tmp_path: Path) -> None:
    assert unwritable_reason(tmp_path / "new.json") is None
    assert not (tmp_path / "new.json").exists()
    old = tmp_path / "old.json"
    old.write_text("kept")
    assert unwritable_reason(old) is None
    assert old.read_text() == "kept"


class FakeLLM:
    """What ``main`` uses of an LLM, without a model: the calibration itself is replaced."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.model_config = type("ModelConfig", (), {"vocab_size": 100, "max_model_len": 2048})()
        worker = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
        self.engine = SimpleNamespace(executor=SimpleNamespace(worker=worker))

    def shutdown(self) -> None:
        pass


def test_a_failed_save_still_prints_the_fit_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    samples = [StepSample(StepShape(p, d, c), 0.001 + 1e-5 * p + 1e-4 * d + 1e-7 * c)
               for p, d, c in ((16, 0, 0), (64, 0, 0), (0, 1, 32), (0, 4, 128), (64, 4, 128))]
    monkeypatch.setattr(calibrate_cost_model, "model_dir_for", lambda *args: tmp_path)
    monkeypatch.setattr(calibrate_cost_model, "LLM", FakeLLM)
    fitted = StepCostModel(1e-3, 1e-5, 1e-4, 1e-7)
    monkeypatch.setattr(calibrate_cost_model, "calibrate", lambda *args, **kwargs: (fitted, samples))

    def failing_save(self: StepCostModel, path: Path, about: object = None) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(StepCostModel, "save", failing_save)
    assert main(["--out", str(tmp_path / "cost.json"), "--device", "cpu", "--quick"]) == 1
    captured = capsys.readouterr()
    assert len(table_rows(captured.out.split("\n", 1)[1])) == len(samples)
    assert "ratio to constant (below 1: the fit is better)" in captured.out
    assert (f"could not write --out {tmp_path / 'cost.json'}: No space left on device; the fit is printed above"
            in captured.err)
