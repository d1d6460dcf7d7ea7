"""bench.step_roofline: each step of a plain run timed and put against its own floor."""

from __future__ import annotations

from kvserve.bench.serving_workloads import ModelCost
from kvserve.bench.step_roofline import StepTime, StepTimes, roofline_rows
from kvserve.scheduler.step_plan import StepPlan

COST = ModelCost(matmul_flops_per_token=10.0, attention_flops_per_pair=2.0, weight_bytes=1000.0, kv_bytes_per_token=4.0)


def plan(new: list[int], cached: list[int]) -> StepPlan:
    n = len(new)
    return StepPlan(0, [f"r{i}" for i in range(n)], new, cached, [5] * sum(new), [0] * n, [], [True] * n, [], [], [])


def test_a_steps_floor_is_the_larger_of_its_arithmetic_and_its_reads() -> None:
    # A chunk of 4 new tokens over 6 cached, and a decode row at position 9.
    step = StepTime.of(plan([4, 1], [6, 9]), seconds=1.0)
    assert step.has_prefill and step.num_tokens == 5
    assert step.attention_pairs == 4 * 6 + 4 * 5 / 2
    assert step.context_tokens == 10 + 10
    flops = 5 * 10.0 + 34 * 2.0
    reads = 1000.0 + 20 * 4.0
    assert step.floor_s(COST, matmul_flops_per_s=1.0, read_bytes_per_s=1e9) == flops
    assert step.floor_s(COST, matmul_flops_per_s=1e9, read_bytes_per_s=1.0) == reads
    decode = StepTime.of(plan([1, 1], [3, 7]), seconds=1.0)
    assert not decode.has_prefill and decode.attention_pairs == 0


def test_rows_sum_the_steps_by_kind_per_run() -> None:
    steps = [StepTime.of(plan([4], [0]), 0.3), StepTime.of(plan([1], [4]), 0.1), StepTime.of(plan([1], [5]), 0.1)] * 2
    rows = roofline_rows("w", steps, runs=2, run_s=1.0, cost=COST, matmul_flops_per_s=100.0, read_bytes_per_s=1e4)
    by_kind = {row[1]: row for row in rows}
    assert by_kind["with prefill"][2:6] == [1, "0.30", "0.30", 4]
    assert by_kind["decode only"][2:6] == [2, "0.20", "0.20", 2]
    assert by_kind["all steps"][2:6] == [3, "0.50", "0.50", 6]
    # Prefill: (4 x 10 + 10 x 2) FLOPs at 100/s = 0.6 s against (1000 + 16) bytes at 1e4/s.
    assert by_kind["with prefill"][6] == "0.60" and by_kind["with prefill"][7] == "0.50"
    without_rates = roofline_rows("w", steps, 2, 1.0, COST, None, None)
    assert all(row[6] == row[7] == "-" for row in without_rates)


def test_a_plain_engine_has_each_of_its_steps_timed(tmp_path) -> None:
    from kvserve import LLM, SamplingParams
    from kvserve.worker.tiny_model import create_tiny_model

    with LLM(create_tiny_model(tmp_path, "llama", seed=0), num_blocks=64) as llm:
        with StepTimes().recording(llm.engine) as times:
            outputs = llm.generate([[5, 6, 7, 8, 9], [10, 11]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert "execute" not in vars(llm.engine.executor)  # the executor's own method is back
        llm.engine.async_scheduling = True  # launched steps, whose time is not their own: not recorded
        with StepTimes().recording(llm.engine) as overlapped:
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        assert overlapped.steps == []
    assert all(len(o.token_ids) == 4 for o in outputs)
    # One step prefills both prompts; three more decode both (the last token of each needs no step).
    assert [s.has_prefill for s in times.steps] == [True, False, False, False]
    assert sum(s.num_tokens for s in times.steps) == 7 + 3 * 2
    assert all(s.seconds > 0 for s in times.steps)
