"""bench.step_pipeline: a decode workload in process and over the step protocol, steps ahead 1 and 2."""

from __future__ import annotations

import argparse
import time

import pytest

from kvserve.bench import step_pipeline
from kvserve.bench.emulated_gpu_worker import EmulatedGpu, EmulatedGpuWorker
from kvserve.scheduler.step_plan import StepPlan


def decode_plan(step_id: int) -> StepPlan:
    return StepPlan(step_id, ["a"], [1], [4], [7], [0], [], [True], [], [], [])


def test_the_stand_in_keeps_its_host_busy_then_runs_its_device_after_the_step_before() -> None:
    worker = EmulatedGpuWorker(EmulatedGpu(host_ms=20.0, device_ms=30.0, num_blocks=8))
    start = time.perf_counter()
    first = worker.launch(decode_plan(0))
    launched = time.perf_counter()
    second = worker.launch(decode_plan(1))
    assert launched - start >= 0.02  # the host's time, spent in launch
    assert first.result().step_id == 0
    assert time.perf_counter() - start >= 0.05  # 20 ms on the host, then 30 ms on the device
    result = second.result()
    # The second step's device time starts after the first's ends: 20 + 30 + 30 ms.
    assert time.perf_counter() - start >= 0.08
    assert result.step_id == 1 and len(result.sampled_token_ids) == 1


def test_the_benchmark_prints_every_mode_with_equal_outputs(capsys) -> None:
    step_pipeline.main(["--requests", "4", "--output-tokens", "6", "--repeat", "1", "--cases", "0.2:0.3"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("|") and "0.2" in line]
    assert [row.split("|")[3].strip() for row in rows] == ["in process", "gRPC, 1 ahead", "gRPC, 2 ahead"]
    for row in rows:
        ms_per_step, tok_s, vs_in_process, of_floor = (float(cell) for cell in row.split("|")[4:8])
        assert ms_per_step > 0 and tok_s > 0 and vs_in_process > 0 and of_floor > 0
    assert rows[0].split("|")[6].strip() == "1.00"
    assert "outputs equal in every mode" in out


@pytest.mark.parametrize("text", ["1.6", "a:1", "1:-2", "1:2,3"])
def test_a_malformed_case_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="HOST_MS:DEVICE_MS"):
        step_pipeline._parse_cases(text)
