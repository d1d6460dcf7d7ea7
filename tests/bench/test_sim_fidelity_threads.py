"""``python -m kvserve.bench.sim_fidelity --threads N``: the real replica's torch threads on a CPU, and a
warning where the cost model was calibrated with another count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import kvserve.bench.sim_fidelity as sim_fidelity
from kvserve.bench.sim_fidelity import main, thread_count_warning
from kvserve.scheduler.cost_model import StepCostModel, cost_model_calibration

# One group of two short requests after one of warm-up: a run takes a second or two on a CPU.
TINY_STREAM = [f"--workload-arg={key}={value}" for key, value in
               dict(num_groups=1, system_prompt_len=16, question_len=4, output_len=2, warmup_per_group=1).items()]


def calibrated_cost_model(path: Path, **about: Any) -> Path:
    StepCostModel(a=2e-3, b=2e-5, c=1e-4, d=0.0).save(path, {"timed": "a tiny Llama", **about})
    return path


@pytest.fixture
def replay_threads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """torch's thread count while the real replica replays its stream (once per run of ``main``)."""
    seen: list[int] = []
    replay = sim_fidelity.replay

    def counting_replay(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return replay(*args, **kwargs)

    monkeypatch.setattr(sim_fidelity, "replay", counting_replay)
    return seen


def run(cost: Path, *args: str) -> int:
    return main(["--cost-model", str(cost), "--device", "cpu", "--requests", "2", "--qps", "50",
                 "--num-blocks", "16", *TINY_STREAM, *args])


def test_threads_sets_the_real_replicas_torch_threads_and_a_calibration_with_another_count_is_warned_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replay_threads: list[int]
) -> None:
    before = torch.get_num_threads()
    cost = calibrated_cost_model(tmp_path / "cost.json", device="cpu", torch_threads=before + 1)

    assert run(cost, "--threads", "1") == 0

    assert replay_threads == [1]
    assert torch.get_num_threads() == before  # the engine's shutdown gave the count back
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: the cost model was calibrated with {before + 1} torch threads, the real replica runs with 1: "
        f"the simulator prices its steps at another speed (--threads {before + 1} matches)"
    ]
    assert "real replica: 3/3 requests finished" in captured.out  # the run went on to its table
    assert " sim, calibrated / real |" in captured.out


def test_without_threads_the_real_replica_keeps_torchs_count_and_a_matching_calibration_is_not_warned_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replay_threads: list[int]
) -> None:
    before = torch.get_num_threads()
    cost = calibrated_cost_model(tmp_path / "cost.json", device="cpu", torch_threads=before)

    assert run(cost) == 0

    assert replay_threads == [before]  # as before --threads existed
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("calibration", "num_threads"),
    [
        ({"device": "cpu", "torch_threads": 4}, 4),  # the same count
        ({"device": "NVIDIA H100 80GB HBM3", "torch_threads": 4}, 1),  # timed on a GPU: threads do not price it
        ({"device": "cpu"}, 1),  # no count recorded
        ({}, 1),  # no calibration block (a hand-written or shipped model)
    ],
)
def test_no_warning_where_the_calibration_names_no_other_cpu_thread_count(
    calibration: dict[str, Any], num_threads: int
) -> None:
    assert thread_count_warning(calibration, num_threads) is None


def test_the_calibration_block_is_read_from_a_file_and_a_shipped_model_has_none(tmp_path: Path) -> None:
    cost = calibrated_cost_model(tmp_path / "cost.json", device="cpu", torch_threads=3)
    assert cost_model_calibration(str(cost)) == {"timed": "a tiny Llama", "device": "cpu", "torch_threads": 3}
    assert cost_model_calibration("llama-3-8b-h100") == {}


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "two"])
def test_a_bad_thread_count_is_a_usage_error_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setattr(sim_fidelity, "model_dir_for", lambda *args, **kwargs: pytest.fail("a model was built"))
    with pytest.raises(SystemExit) as info:
        run(calibrated_cost_model(tmp_path / "cost.json"), "--threads", value)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --threads: expected an integer >= 1, got '{value}'" in err
    assert "Traceback" not in err


def test_help_says_what_threads_does_and_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert (f"--threads N torch threads of the real replica on a CPU (no effect on a GPU; default: torch's own "
            f"count, {torch.get_num_threads()} here)") in help_text
