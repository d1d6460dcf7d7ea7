"""bench.step_pipeline: a decode or mixed workload in process and over the step protocol, steps ahead 1 and 2."""

from __future__ import annotations

import argparse
import time

import pytest

from kvserve.bench import step_pipeline
from kvserve.bench.emulated_gpu_worker import VOCAB_SIZE, EmulatedGpu, EmulatedGpuWorker
from kvserve.bench.serving_workloads import make_workloads
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


def test_a_step_with_prompt_tokens_costs_its_eager_host_time_and_every_token_its_device_time() -> None:
    gpu = EmulatedGpu(host_ms=1.0, device_ms=2.0, num_blocks=8, prefill_host_ms=10.0, device_us_per_token=500.0)
    assert gpu.costs_ms(decode_plan(0)) == (1.0, 2.5)
    # One request's 3-token chunk beside a decode row: 4 tokens, eager.
    mixed = StepPlan(1, ["a", "b"], [3, 1], [0, 4], [5, 6, 7, 8], [1, 0], [3], [False, True], [], [], [])
    assert gpu.costs_ms(mixed) == (10.0, 4.0)
    assert EmulatedGpu(1.0, 2.0, 8).costs_ms(mixed) == (1.0, 2.0)  # no eager time given: the graphed one

    worker = EmulatedGpuWorker(gpu)
    worker.launch(decode_plan(0))
    worker.launch(mixed)
    assert (worker.num_launched, worker.launched_host_ms, worker.launched_device_ms) == (2, 11.0, 6.5)


@pytest.mark.parametrize(
    ("args", "case"),
    [(["--cases", "0.2:0.3"], "0.2:0.3"),
     (["--workload", "mixed", "--cases", "0.2:0.3:0.5:0.1"], "0.2:0.3:0.5:0.1")],
)
def test_the_benchmark_prints_every_mode_with_equal_outputs(capsys, args: list[str], case: str) -> None:
    step_pipeline.main(["--requests", "4", "--output-tokens", "6", "--repeat", "1", *args])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("|") and case in line]
    assert [row.split("|")[1].strip() for row in rows] == [case] * 3
    assert [row.split("|")[2].strip() for row in rows] == ["in process", "gRPC, 1 ahead", "gRPC, 2 ahead"]
    for row in rows:
        ms_per_step, tok_s, vs_in_process, of_floor = (float(cell) for cell in row.split("|")[3:7])
        assert ms_per_step > 0 and tok_s > 0 and vs_in_process > 0 and 0 < of_floor <= 1.0
    assert rows[0].split("|")[5].strip() == "1.00"
    assert "outputs equal in every mode" in out


def test_the_mixed_workload_is_gpu_servings_own_chunked_in_steps_of_2048() -> None:
    workload = step_pipeline.Workload.mixed(64, 8)
    served = make_workloads(VOCAB_SIZE)[0]
    assert served.name == "mixed" and len(served.prompts) == 256
    assert workload.prompt_lens == tuple(len(p) for p in served.prompts[:64])
    assert min(workload.prompt_lens) >= 128 and max(workload.prompt_lens) <= 1024 and workload.step_tokens == 2048
    gpu = EmulatedGpu(0.0, 0.0, workload.num_blocks, 0.0, 0.0)
    run = step_pipeline.run_in_process(gpu, workload, run=0)
    # Every prompt token is computed once, 2,048 at most a step, then one step per further output token.
    assert run.steps >= -(-sum(workload.prompt_lens) // 2048) + 7
    assert [len(tokens) for tokens in run.outputs] == [8] * 64


def test_more_requests_than_the_mixed_workload_has_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        step_pipeline.main(["--workload", "mixed", "--requests", "257"])
    assert info.value.code == 2
    assert "--requests: the mixed workload has 256 requests, got 257" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["1.6", "a:1", "1:-2", "1:2,3", "1:2:3", "1:2:3:4:5", "1:2:-3:4"])
def test_a_malformed_case_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"HOST_MS:DEVICE_MS\[:PREFILL_HOST_MS:DEVICE_US_PER_TOKEN\]"):
        step_pipeline._parse_cases(text)
