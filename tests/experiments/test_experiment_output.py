"""What ``kvserve experiment`` tells its reader: the setup it records and prints, its notes, its progress."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import pytest

from kvserve.cluster.launcher import replica_ready_line
from kvserve.experiments import experiment_runs
from kvserve.experiments.experiment import add_experiment_parser, run_experiment
from kvserve.experiments.experiment_fleet import sizing_stream
from kvserve.experiments.experiment_notes import small_sample_note
from kvserve.experiments.experiment_report import REQUEST_CSV_FIELDS, SUMMARY_HEADERS, RunSummary, summary_rows
from kvserve.experiments.experiment_output import prepare_output
from kvserve.experiments.experiment_setup import StreamSpec
from kvserve.experiments.workloads.cache_reference import infinite_cache_reference
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.simulation.simulator import FleetConfig


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_experiment_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["experiment", *argv])


SMALL = ["--workload", "shared_prefix", "--workload-arg", "num_groups=4", "--workload-arg", "system_prompt_len=32",
         "--workload-arg", "question_len=8", "--workload-arg", "output_len=4", "--replicas", "2", "--no-plots"]


def run(argv: list[str], capsys) -> str:  # noqa: ANN001
    """Stdout of an experiment that must succeed."""
    assert run_experiment(parse(argv)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_prompts_per_group_with_a_short_run_sizes_the_caches_on_as_many_prompts_per_group(  # noqa: ANN001
    tmp_path, capsys
) -> None:
    # The caches are sized on 2,000 requests: 4 x 10 made it "num_requests (2000) must be num_groups x ...".
    out = run([*SMALL, "--num-requests", "40", "--workload-arg", "prompts_per_group=10", "--qps", "5",
               "--policies", "round_robin", "--kv-fraction", "2", "--out", str(tmp_path / "run")], capsys)

    assert "with 2,000 requests, the default for 2 replicas, prompts_per_group=500" in out
    assert "40 measured" in out


def test_the_sizing_stream_keeps_the_groups_and_comes_nearest_the_default_length() -> None:
    args = argparse.Namespace(kv_blocks_per_replica=None, replicas=8)
    stream = StreamSpec("shared_prefix", 21, 0, 1.0, {"num_groups": 3, "prompts_per_group": 7})

    sizing = sizing_stream(args, stream)

    assert sizing is not None and sizing.num_requests == 2_001
    assert sizing.params == {"num_groups": 3, "prompts_per_group": 667}
    assert len([r for r in sizing.at(1.0) if r.measured]) == 2_001


def test_config_json_records_the_cost_model_and_every_workload_parameter(tmp_path, capsys) -> None:  # noqa: ANN001
    run([*SMALL, "--num-requests", "40", "--qps", "5", "--policies", "round_robin", "--kv-fraction", "2",
         "--out", str(tmp_path / "run")], capsys)

    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["cost_model"] == {"name": "StepCostModel.default()", "a": 7e-3, "b": 5e-5, "c": 6e-5, "d": 4e-8}
    assert config["model"] is None
    assert config["workload_params"] == {
        "num_groups": 4, "system_prompt_len": 32, "question_len": 8, "output_len": 4, "zipf_exponent": 0.0,
        "prompts_per_group": None, "num_tenants": 0, "warmup_per_group": 4, "vocab_size": 32_000,
    }


def test_config_json_records_a_live_runs_model_and_the_vocabulary_its_stream_used(tmp_path) -> None:  # noqa: ANN001
    args = parse([*SMALL, "--qps", "5", "--live", "--model", "/models/tiny", "--out", str(tmp_path / "run")])
    stream = StreamSpec("shared_prefix", 8, 0, 1.0, {"num_groups": 4}).with_vocab_size(1000)
    reference = infinite_cache_reference(stream.at(1.0), 16)
    fleet = FleetConfig(num_replicas=2, scheduler_config=SchedulerConfig(max_model_len=4096),
                        cache_config=CacheConfig(block_size=16, num_blocks=321), cost_model=StepCostModel.default())

    prepare_output(args, (), stream, reference, reference, fleet, "/models/tiny")

    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["model"] == "/models/tiny"
    assert config["workload_params"]["num_groups"] == 4 and config["workload_params"]["vocab_size"] == 1000


def test_a_trace_shorter_than_num_requests_is_noted(tmp_path, capsys) -> None:  # noqa: ANN001
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": 100 * i, "input_length": 40, "output_length": 4, "hash_ids": [i % 3]}) + "\n"
        for i in range(30)
    ))
    argv = ["--workload", "mooncake", "--trace", str(trace), "--replicas", "2", "--kv-blocks-per-replica", "16",
            "--qps", "5", "--policies", "round_robin", "--no-plots"]

    out = run([*argv, "--num-requests", "50", "--out", str(tmp_path / "more")], capsys)
    assert ("note: the trace holds only 30 records, fewer than --num-requests 50: all of them run, "
            "27 measured after a warm-up of 3") in out
    assert "the trace holds only" not in run([*argv, "--num-requests", "20", "--out", str(tmp_path / "cut")], capsys)


def test_a_replica_ready_line_counts_the_usable_blocks_as_the_fleet_line_does() -> None:
    # A pool of 321 blocks: the null block and 320 usable, as "2 replicas x 320 KV blocks" says.
    assert replica_ready_line(0, 321) == "replica 0 ready (320 usable KV blocks)"


def summary(policy: str, ttft_p99: float, hit_vs_infinite: float) -> RunSummary:
    return RunSummary(
        workload="shared_prefix", num_replicas=8, qps=10.0, policy=policy, num_requests=100, hit_rate=0.9,
        infinite_hit_rate=0.91, hit_vs_infinite=hit_vs_infinite, ttft_p50=0.02, ttft_p99=ttft_p99, e2e_p50=2.2,
        e2e_p99=2.6, throughput=7474.0, load_imbalance=1.1, busy_imbalance=1.0, num_preemptions=0, wall_seconds=1.0,
    )


def test_every_ratio_column_says_which_way_is_better() -> None:
    ratio_columns = [h for h in SUMMARY_HEADERS if "vs " in h or "max/mean" in h]

    assert len(ratio_columns) == 4
    assert all(h.endswith("(lower is better)") or h.endswith("(higher is better)") for h in ratio_columns)


def test_the_hit_rate_against_an_infinite_cache_has_three_decimals() -> None:
    # 0.997 printed as 1.00 read as "as good as an infinite cache".
    [row] = summary_rows([summary("cost_ttft", 0.1, 0.997)], "cost_ttft")

    assert row[SUMMARY_HEADERS.index("vs infinite (higher is better)")] == "0.997"


def test_summary_md_holds_the_setup_printed_at_the_start(tmp_path, capsys) -> None:  # noqa: ANN001
    out = run([*SMALL, "--num-requests", "40", "--qps", "5", "--policies", "round_robin", "--kv-fraction", "2",
               "--seed", "3", "--out", str(tmp_path / "run")], capsys)

    markdown = (tmp_path / "run" / "summary.md").read_text()
    for start in ("workload shared_prefix", "fleet: 2 replicas x", "step cost: a="):
        [line] = [line for line in out.splitlines() if line.startswith(start)]
        assert line in markdown
    assert "40 requests, seed 3" in markdown and "(StepCostModel.default())" in markdown


def test_help_gives_every_csv_column_and_its_unit(capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit):
        parse(["--help"])
    text = capsys.readouterr().out

    for column in [*(f.name for f in dataclasses.fields(RunSummary)), *REQUEST_CSV_FIELDS]:
        assert column in text, column
    assert "ttft_p50, ttft_p99   time to first token percentiles, seconds (the table shows milliseconds)" in text
    assert "throughput           output tokens/s" in text


@pytest.mark.timing
def test_a_quick_experiment_prints_no_progress_lines(tmp_path, capsys) -> None:  # noqa: ANN001
    assert run_experiment(parse([*SMALL, "--num-requests", "40", "--qps", "5,10", "--policies", "round_robin",
                                 "--kv-fraction", "2", "--out", str(tmp_path / "run")])) == 0

    assert capsys.readouterr().err.splitlines() == ["2 runs"]


@pytest.mark.timing
def test_a_stage_is_said_only_once_it_has_taken_a_while(monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setattr(experiment_runs, "QUIET_SECONDS", 0.05)
    with experiment_runs.stage("computing something quick"):
        pass
    with experiment_runs.stage("computing something slow"):
        time.sleep(0.2)
    time.sleep(0.1)  # past the quick stage's time too: it stays unsaid

    assert capsys.readouterr().err.splitlines() == ["computing something slow"]


def test_a_small_sample_is_noted_and_a_large_one_is_not(tmp_path, capsys) -> None:  # noqa: ANN001
    out = run([*SMALL, "--num-requests", "40", "--qps", "5", "--policies", "round_robin", "--kv-fraction", "2",
               "--out", str(tmp_path / "run")], capsys)

    assert "note: each run measures only 40 requests: TTFT p99 is near the largest TTFT" in out
    assert "differs from seed to seed" in out
    assert small_sample_note(1_000) is None


def test_one_replica_is_noted_as_leaving_routing_no_choice(tmp_path, capsys) -> None:  # noqa: ANN001
    argv = [*SMALL, "--num-requests", "40", "--qps", "5", "--kv-fraction", "2"]
    argv += ["--policies", "round_robin,cache_aware"]
    one = run([*argv, "--replicas", "1", "--out", str(tmp_path / "one")], capsys)
    two = run([*argv, "--out", str(tmp_path / "two")], capsys)

    assert "note: with 1 replica routing has no choice" in one
    assert "routing has no choice" not in two


def test_the_workload_is_printed_as_key_value_pairs(tmp_path, capsys) -> None:  # noqa: ANN001
    out = run([*SMALL, "--num-requests", "40", "--qps", "5", "--policies", "round_robin", "--kv-fraction", "2",
               "--out", str(tmp_path / "run")], capsys)

    assert "workload shared_prefix num_groups=4 system_prompt_len=32 question_len=8 output_len=4: 40 requests" in out


def test_an_unknown_workload_parameter_lists_the_parameters_and_their_defaults(tmp_path, capsys) -> None:  # noqa: ANN001
    argv = [*SMALL, "--qps", "5", "--workload-arg", "nope=3", "--out", str(tmp_path / "run")]
    assert run_experiment(parse(argv)) == 2

    err = capsys.readouterr().err
    assert "--workload-arg: the shared_prefix workload has no parameter nope; its parameters (with their defaults): " in err
    assert "num_groups=64, system_prompt_len=2048, question_len=128" in err and "Traceback" not in err
    assert not Path(tmp_path / "run").exists()
