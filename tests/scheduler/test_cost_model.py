"""The step cost model: pricing plans, fitting, persistence, and calibration on an executor."""

from __future__ import annotations

import json

import pytest

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.simulation.calibration import CalibrationGrid, calibrate
from kvserve.scheduler.cost_model import StepCostModel, StepSample, StepShape, measured_cost_models
from kvserve.scheduler.simulation.simulated_executor import SimulatedExecutor
from kvserve.scheduler.step_plan import StepPlan

MODEL = StepCostModel(a=0.005, b=1e-4, c=2e-4, d=1e-6)


def mixed_plan() -> StepPlan:
    """Two decodes (contexts 10 and 20) and a 30-token prefill chunk starting at 40."""
    return StepPlan(
        step_id=0, req_ids=["d1", "d2", "p"], num_scheduled_tokens=[1, 1, 30],
        num_computed_tokens=[10, 20, 40], token_ids=[0] * 32, num_new_block_ids=[0, 0, 0],
        new_block_ids=[], sample=[True, True, False], new_requests=[], finished_req_ids=[], preempted_req_ids=[],
    )


def test_step_time_prices_prefill_tokens_decodes_and_context() -> None:
    plan = mixed_plan()

    assert StepShape.of(plan) == StepShape(num_prefill_tokens=30, num_decode_requests=2, num_context_tokens=102)
    assert MODEL.step_time(plan) == pytest.approx(0.005 + 30e-4 + 2 * 2e-4 + 102e-6)


def test_an_empty_plan_takes_no_time() -> None:
    plan = StepPlan(0, [], [], [], [], [], [], [], [], ["gone"], [])

    assert MODEL.step_time(plan) == 0.0


def test_fit_recovers_the_coefficients_of_exact_samples() -> None:
    shapes = [StepShape(p, n, c) for p in (0, 100, 1000) for n in (0, 8, 64) for c in (0, 5000, 40_000) if p or n]
    samples = [StepSample(shape, MODEL.shape_time(shape)) for shape in shapes]

    fitted = StepCostModel.fit(samples)

    for name in ("a", "b", "c", "d"):
        assert getattr(fitted, name) == pytest.approx(getattr(MODEL, name), rel=1e-6)


def test_fit_never_returns_a_negative_coefficient() -> None:
    # Context costs nothing and the noise makes its least-squares coefficient negative.
    shapes = [StepShape(100 * k, k, 1000 * (5 - k)) for k in range(1, 5)] + [StepShape(0, 1, 9000)]
    samples = [StepSample(s, 0.01 + 1e-4 * s.num_prefill_tokens - 1e-7 * s.num_context_tokens) for s in shapes]

    fitted = StepCostModel.fit(samples)

    assert min(fitted.a, fitted.b, fitted.c, fitted.d) >= 0.0
    assert fitted.d == 0.0


def test_cost_model_round_trips_through_json(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "cost.json"
    MODEL.save(path)

    assert StepCostModel.load(path) == MODEL


def test_a_calibrations_description_is_saved_with_the_coefficients_and_ignored_on_load(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "cost.json"
    MODEL.save(path, {"device": "NVIDIA H100", "mean_relative_error": 0.05})

    assert json.loads(path.read_text())["calibration"] == {"device": "NVIDIA H100", "mean_relative_error": 0.05}
    assert StepCostModel.load(path) == MODEL


def test_a_measured_model_loads_by_name_and_a_file_of_that_name_comes_first(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    assert "llama-3-8b-h100" in measured_cost_models()
    measured = StepCostModel.load("llama-3-8b-h100")
    assert 0.005 < measured.a < 0.05 and measured.d == 0.0  # the H100 fit: an 11.4 ms floor
    monkeypatch.chdir(tmp_path)
    MODEL.save(tmp_path / "llama-3-8b-h100")
    assert StepCostModel.load("llama-3-8b-h100") == MODEL


def test_a_path_that_is_neither_file_nor_name_lists_the_names(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(FileNotFoundError, match=r"no such file, nor a measured cost model of that name \(llama-3-8b-h100"):
        StepCostModel.load(tmp_path / "missing.json")


@pytest.mark.parametrize("bad", [dict(a=-1.0), dict(b=float("nan")), dict(a=0.0, b=0.0, c=0.0, d=0.0)])
def test_invalid_coefficients_are_rejected(bad: dict[str, float]) -> None:
    values = dict(a=0.01, b=1e-4, c=1e-4, d=1e-7) | bad

    with pytest.raises(ValueError):
        StepCostModel(**values)


def test_calibrate_recovers_the_model_of_an_executor_that_follows_it() -> None:
    """A simulated executor on a fake clock: calibration must find its cost model again."""
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    executor = SimulatedExecutor(MODEL, num_kv_blocks=2048, vocab_size=100, sleep=sleep)
    grid = CalibrationGrid(prefill_lengths=(16, 64, 256), decode_batches=(1, 4, 8), context_lengths=(32, 96), repeats=1)

    fitted, samples = calibrate(executor, block_size=16, vocab_size=100, grid=grid, clock=lambda: clock[0])

    assert len(samples) == 3 + 2 * 3 * 2
    for name in ("a", "b", "c", "d"):
        assert getattr(fitted, name) == pytest.approx(getattr(MODEL, name), rel=1e-6, abs=1e-12)


def test_step_shape_of_a_real_scheduler_plan_counts_chunks_as_prefill() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=256), CacheConfig(block_size=4, num_blocks=64))
    scheduler.add_request(Request("a", list(range(100)), SamplingParams(max_tokens=4)))

    shape = StepShape.of(scheduler.schedule())

    assert shape == StepShape(num_prefill_tokens=64, num_decode_requests=0, num_context_tokens=64)
