"""``python -m kvserve.bench.sim_fidelity``: a real engine replays a stream on the wall clock, and
the simulator's figures are set beside its."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from kvserve import LLM
from kvserve.bench.sim_fidelity import main, ratio_table, replay, simulate, summarize_measured
from kvserve.experiments.experiment_report import summarize
from kvserve.experiments.workloads import make_workload
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
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
    # All 8 arrive within a few milliseconds, and the others ask for 10x the first's tokens: they still
    # run when it finishes, even where a loaded machine puts all 8 in its first step.
    first, *others = make_workload("shared_prefix", 8, 5000.0, seed=3, **SMALL_STREAM)
    stream = [first, *(dataclasses.replace(request, output_len=10 * first.output_len) for request in others)]

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
    # No vocab_size: token ids come from the tiny model's vocabulary of 1,000 (the workload's default is 32,000).
    stream = {key: value for key, value in SMALL_STREAM.items() if key != "vocab_size"} | {"warmup_per_group": 1}
    workload_args = [f"--workload-arg={key}={value}" for key, value in stream.items()]
    assert main(["--cost-model", str(cost), "--device", "cpu", "--requests", "10", "--qps", "20",
                 "--num-blocks", "64", *workload_args]) == 0
    out = capsys.readouterr().out
    # --requests counts the measured requests; each of the 2 groups adds one of warm-up.
    assert ("shared_prefix at 20 qps on one replica (64 KV blocks of 16 tokens): "
            "12 requests replayed, 10 measured (the rest warm-up)") in out
    assert "real replica: 12/12 requests finished" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("|")}
    assert {"real replica", "sim, calibrated", "sim, default()",
            "sim, calibrated / real", "sim, default() / real"} <= set(rows)


def test_the_figures_cover_the_measured_requests_only() -> None:
    # Two groups, two warm-up requests each: the warm-up pays the cold prefills of the system prompts.
    stream = make_workload("shared_prefix", 6, 20.0, seed=3, **(SMALL_STREAM | {"warmup_per_group": 2}))
    assert sum(not r.measured for r in stream) == 4
    result = simulate(stream, SchedulerConfig(max_model_len=64), CacheConfig(block_size=16, num_blocks=64),
                      StepCostModel.default(), "sim")

    (measured,) = summarize_measured([result], stream, workload="shared_prefix", qps=20.0)
    whole = summarize(result, workload="shared_prefix", qps=20.0, infinite_hit_rate=0.0)

    assert (measured.num_requests, whole.num_requests) == (6, 10)
    # Every measured request finds its group's 48-token system prompt (3 blocks) cached.
    assert measured.hit_rate == pytest.approx(6 * 48 / sum(len(r.prompt_token_ids) for r in stream if r.measured))
    assert whole.hit_rate < measured.hit_rate


def test_the_ratio_table_heads_its_unitless_columns_as_ratios() -> None:
    stream = make_workload("shared_prefix", 6, 20.0, seed=3, **(SMALL_STREAM | {"warmup_per_group": 1}))
    runs = [simulate(stream, SchedulerConfig(max_model_len=64), CacheConfig(block_size=16, num_blocks=64),
                     StepCostModel.default(), name) for name in ("real", "sim")]
    text = ratio_table(summarize_measured(runs, stream, workload="shared_prefix", qps=20.0))
    header, _, row = ([cell.strip() for cell in line.split("|")[1:-1]] for line in text.splitlines())
    assert header == ["ratio (1.00x: as the real run)", "hit rate: sim / real", "TTFT p50: sim / real",
                      "TTFT p99: sim / real", "e2e p50: sim / real", "e2e p99: sim / real"]
    # The same simulation twice: every figure is 1.00x the "real" one's.
    assert row == ["sim / real", "1.00x", "1.00x", "1.00x", "1.00x", "1.00x"]


def test_a_vocabulary_beyond_the_models_is_a_usage_error_before_the_model_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvserve.bench.sim_fidelity as sim_fidelity

    monkeypatch.setattr(sim_fidelity, "model_dir_for", lambda *args, **kwargs: pytest.fail("a model was built"))
    cost = tmp_path / "cost.json"
    StepCostModel.default().save(cost)
    with pytest.raises(SystemExit) as info:
        main(["--cost-model", str(cost), "--device", "cpu", "--requests", "2", "--workload-arg", "num_groups=1",
              "--workload-arg", "system_prompt_len=16", "--workload-arg", "vocab_size=32000"])
    assert info.value.code == 2
    assert "--workload-arg vocab_size=32000 exceeds the model's vocabulary of 1000" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--requests", "0"], "expected an integer >= 1, got '0'"),  # max() of an empty stream
        (["--num-blocks", "1"], "expected an integer >= 2, got '1'"),
        (["--max-num-seqs", "0"], "expected an integer >= 1, got '0'"),
        # 48 + 8 + 5 = 61 tokens need 4 blocks of 16: it failed mid-run, after real work.
        (["--num-blocks", "4"], "the workload's longest request (61 tokens) needs 4 KV blocks; give --num-blocks 5"),
        (["--model", "/nonexistent/model"], "--model: '/nonexistent/model' is not a model directory"),
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
