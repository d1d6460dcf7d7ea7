"""``python -m kvserve.bench.sim_fidelity``: a real engine replays a stream on the wall clock, and
the simulator's figures are set beside its."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvserve import LLM
from kvserve.bench.sim_fidelity import main, replay
from kvserve.experiments.workloads import make_workload
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.worker.tiny_model import create_tiny_model

# No warm-up: the benchmark replays every request, and the tests count them.
SMALL_STREAM = dict(num_groups=2, system_prompt_len=48, question_len=8, output_len=5, vocab_size=1000, warmup_per_group=0)


def test_replay_serves_each_request_after_its_arrival(tmp_path: Path) -> None:
    stream = make_workload("shared_prefix", 8, 40.0, seed=3, **SMALL_STREAM)
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        time.sleep(seconds)

    with LLM(create_tiny_model(tmp_path / "m"), num_blocks=64, block_size=16) as llm:
        result = replay(llm.engine, stream, sleep=sleep)
        assert not llm.engine.has_unfinished_requests()

    assert [r.index for r in result.records] == list(range(len(stream)))
    for record, item in zip(result.records, stream):
        assert record.arrival_time == item.arrival_time
        assert item.arrival_time < record.first_token_time <= record.finish_time <= result.end_time
        assert record.num_output_tokens == item.output_len == 5
        assert record.num_prompt_tokens == len(item.prompt_token_ids)
    # The second request of a group finds its 48-token system prompt (3 blocks) cached.
    assert sum(r.num_cached_tokens for r in result.records) >= 6 * 48
    assert waits and min(waits) >= 0  # it waited for arrivals rather than spinning
    assert 0 < result.replica_busy_time[0] <= result.end_time


def test_an_interrupted_replay_leaves_nothing_running_in_the_engine(tmp_path: Path) -> None:
    # All 8 arrive within a few milliseconds: the others still run when the first finishes.
    stream = make_workload("shared_prefix", 8, 5000.0, seed=3, **SMALL_STREAM)

    def interrupt_at_the_first(finished: int, total: int) -> None:
        assert llm.engine.has_unfinished_requests()
        raise KeyboardInterrupt

    with LLM(create_tiny_model(tmp_path / "m"), num_blocks=64, block_size=16) as llm:
        with pytest.raises(KeyboardInterrupt):
            replay(llm.engine, stream, progress=interrupt_at_the_first)
        assert not llm.engine.has_unfinished_requests()


def test_the_table_sets_the_simulator_beside_the_real_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cost = tmp_path / "cost.json"
    StepCostModel(a=2e-3, b=2e-5, c=1e-4, d=0.0).save(cost)
    workload_args = [f"--workload-arg={key}={value}" for key, value in SMALL_STREAM.items()]
    assert main(["--cost-model", str(cost), "--device", "cpu", "--requests", "10", "--qps", "20",
                 "--num-blocks", "64", *workload_args]) == 0
    out = capsys.readouterr().out
    assert "shared_prefix: 10 requests at 20 qps on one replica (64 KV blocks of 16 tokens)" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("|")}
    assert {"real replica", "sim, calibrated", "sim, default()",
            "sim, calibrated / real", "sim, default() / real"} <= set(rows)


def test_token_ids_beyond_the_model_are_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cost = tmp_path / "cost.json"
    StepCostModel.default().save(cost)
    with pytest.raises(SystemExit) as info:
        main(["--cost-model", str(cost), "--device", "cpu", "--requests", "2",
              "--workload-arg", "num_groups=1", "--workload-arg", "system_prompt_len=16"])
    assert info.value.code == 2
    assert "give --workload-arg vocab_size=1000" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--requests", "0"], "expected an integer >= 1, got '0'"),  # max() of an empty stream
        (["--num-blocks", "1"], "expected an integer >= 2, got '1'"),
        (["--max-num-seqs", "0"], "expected an integer >= 1, got '0'"),
        # 48 + 8 + 5 = 61 tokens need 4 blocks of 16: it failed mid-run, after real work.
        (["--num-blocks", "4"], "the workload's longest request (61 tokens) needs 4 KV blocks; give --num-blocks 5"),
        (["--model", "/nonexistent/model"], "--model: /nonexistent/model is not a model directory"),
    ],
)
def test_bad_settings_are_usage_errors_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    cost = tmp_path / "cost.json"
    StepCostModel.default().save(cost)
    workload_args = [f"--workload-arg={key}={value}" for key, value in SMALL_STREAM.items()]
    with pytest.raises(SystemExit) as info:
        main(["--cost-model", str(cost), "--device", "cpu", "--requests", "4", *workload_args, *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_a_workload_longer_than_the_model_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # It said "max_model_len must be in [1, 32], got 61", a setting the user never gave.
    cost = tmp_path / "cost.json"
    StepCostModel.default().save(cost)
    model = create_tiny_model(tmp_path / "m", max_position_embeddings=32)
    workload_args = [f"--workload-arg={key}={value}" for key, value in SMALL_STREAM.items()]
    with pytest.raises(SystemExit):
        main(["--cost-model", str(cost), "--model", str(model), "--device", "cpu", "--requests", "4", *workload_args])
    assert f"the workload's longest request (61 tokens) exceeds the 32 tokens {model} serves" in capsys.readouterr().err
