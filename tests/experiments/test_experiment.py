"""``kvserve experiment --sim`` on a tiny run: files, table, same stream for every policy, bad setups."""

from __future__ import annotations

import argparse
import csv
import functools
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserve.experiments import experiment, experiment_runs
from kvserve.experiments.experiment import add_experiment_parser, run_experiment
from kvserve.experiments.experiment_report import atomic_open
from kvserve.experiments.experiment_fleet import FLEET_BYTES_PER_BLOCK, check_fleet_memory
from kvserve.experiments.experiment_setup import (
    DEFAULT_TIME_SCALE,
    ExperimentError,
    check_live_options,
    default_num_requests,
    qps_label,
)
from kvserve.experiments.workloads import WorkloadRequest, make_workload, sessions
from kvserve.experiments.workloads.cache_reference import CacheReference, infinite_cache_reference
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.simulation.simulator import FleetConfig, FleetSimulator


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_experiment_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["experiment", *argv])


TINY_WORKLOAD = [
    "--workload", "shared_prefix", "--workload-arg", "num_groups=6", "--workload-arg", "system_prompt_len=128",
    "--workload-arg", "question_len=16", "--workload-arg", "output_len=8",
]
TINY = [*TINY_WORKLOAD, "--replicas", "3", "--num-requests", "80"]


def test_a_tiny_experiment_writes_requests_summary_and_plots(tmp_path, capsys, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(experiment_runs, "QUIET_SECONDS", 0.0)  # every progress line, however quick the run
    out = tmp_path / "run"
    args = parse([*TINY, "--sim", "--policies", "round_robin,cache_aware,cost_ttft", "--qps", "5,20", "--out", str(out)])

    assert args.handler(args) == 0

    printed = capsys.readouterr()
    assert "cost_ttft" in printed.out and "TTFT p99 vs baseline" in printed.out
    assert "100%" in printed.err
    for name in ("requests.csv", "summary.csv", "summary.md", "config.json", "hit_rate_vs_qps.png", "ttft_p99_vs_qps.png"):
        assert (out / name).stat().st_size > 0
    with open(out / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    # 80 measured requests after a warm-up of 4 per group, per policy and rate.
    assert len(rows) == 3 * 2 * (80 + 4 * 6)
    assert sum(row["measured"] == "1" for row in rows) == 3 * 2 * 80
    prompts = {}
    for row in rows:
        prompts.setdefault((row["qps"], row["index"]), set()).add(row["num_prompt_tokens"])
    assert all(len(lengths) == 1 for lengths in prompts.values())  # one stream for every policy
    with open(out / "summary.csv") as f:
        summary = list(csv.DictReader(f))
    assert [(s["policy"], float(s["qps"])) for s in summary] == [
        (p, q) for q in (5.0, 20.0) for p in ("round_robin", "cache_aware", "cost_ttft")
    ]
    assert all(0.0 <= float(s["hit_rate"]) <= 1.0 for s in summary)


def test_without_num_requests_a_run_has_250_requests_per_replica_within_bounds(tmp_path) -> None:  # noqa: ANN001
    assert [default_num_requests(n) for n in (1, 8, 9, 64, 400, 401, 1000)] == [
        2000, 2000, 2250, 16000, 100000, 100000, 100000
    ]
    out = tmp_path / "run"
    args = parse([*TINY_WORKLOAD, "--replicas", "9", "--policies", "round_robin",
                  "--qps", "200", "--out", str(out), "--no-plots"])
    assert run_experiment(args) == 0
    with open(out / "requests.csv") as f:
        assert sum(row["measured"] == "1" for row in csv.DictReader(f)) == 2250


def test_parallel_jobs_give_the_same_summary_as_one(tmp_path) -> None:  # noqa: ANN001
    summaries = []
    for jobs in (1, 2):
        out = tmp_path / f"jobs{jobs}"
        args = parse([*TINY, "--policies", "least_loaded,consistent_hash", "--qps", "10", "--out", str(out),
                      "--jobs", str(jobs), "--no-plots"])
        assert run_experiment(args) == 0
        with open(out / "summary.csv") as f:
            summaries.append([{k: v for k, v in row.items() if k != "wall_seconds"} for row in csv.DictReader(f)])

    assert summaries[0] == summaries[1]


def test_several_processes_per_simulation_give_the_same_summary_as_one(tmp_path) -> None:  # noqa: ANN001
    summaries = []
    for processes in (1, 2):
        out = tmp_path / f"processes{processes}"
        # The knee search simulates with them too.
        args = parse([*TINY, "--policies", "cache_aware,cost_ttft", "--qps", "knee", "--out", str(out),
                      "--sim-processes", str(processes), "--jobs", "2", "--no-plots"])
        assert run_experiment(args) == 0
        with open(out / "summary.csv") as f:
            summaries.append([{k: v for k, v in row.items() if k != "wall_seconds"} for row in csv.DictReader(f)])

    assert summaries[0] == summaries[1]
    assert not multiprocessing.active_children()


def test_sim_processes_reach_every_simulation_the_knee_search_s_too(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    built: list[int] = []
    original = FleetSimulator.__init__

    def spy(self, *args, processes: int = 1, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        built.append(processes)
        original(self, *args, processes=processes, **kwargs)

    monkeypatch.setattr(FleetSimulator, "__init__", spy)
    args = parse([*TINY, "--policies", "cache_aware", "--qps", "knee", "--out", str(tmp_path / "run"),
                  "--sim-processes", "2", "--no-plots"])

    assert run_experiment(args) == 0
    assert len(built) > 2 and set(built) == {2}  # the search's runs, then the policies'


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--sim", "--address", "auto"], "--address is only for --live"),
        (["--time-scale", "2"], "--time-scale is only for --live"),
        (["--model", "/nonexistent/model", "--time-scale", "2"], "--model and --time-scale are only for --live"),
        (["--live", "--address", "head-node"], "--address: expected 'auto' or HOST:PORT"),
        (["--live", "--address", "127.0.0.1:99999"], "--address: expected 'auto' or HOST:PORT"),
        (["--live", "--jobs", "2"], "--jobs is for simulations"),
        (["--live", "--sim-processes", "2"], "--sim-processes is for simulations"),
        (["--live", "--time-scale", "0"], "--time-scale must be a positive number"),
        (["--live", "--model", "/nonexistent/model"], "config.json"),
    ],
)
def test_live_only_options_are_checked_before_anything_starts(tmp_path, capsys, extra, message) -> None:  # noqa: ANN001
    args = parse([*TINY, *extra, "--qps", "1", "--out", str(tmp_path)])

    assert run_experiment(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policies", "random", "--qps", "1"], "unknown policies"),
        (["--qps", "fast"], "--qps"),
        (["--qps", "1", "--kv-blocks-per-replica", "3"], "cannot hold the longest request"),
        (["--qps", "knee", "--knee-factor", "1000"], "--qps knee: the baseline's TTFT p99 never reached 1000x"),
    ],
)
def test_bad_setups_are_reported_without_a_traceback(tmp_path, capsys, extra, message) -> None:  # noqa: ANN001
    args = parse([*TINY, *extra, "--out", str(tmp_path)])

    assert run_experiment(args) == 2
    assert message in capsys.readouterr().err


def test_a_cache_fraction_too_small_for_the_longest_request_names_the_least_that_fits(tmp_path, capsys) -> None:  # noqa: ANN001
    err = run_bad([*TINY, "--qps", "1", "--kv-fraction", "0.01", "--no-plots", "--out", str(tmp_path / "a")], capsys)

    assert err.strip() == (
        "kvserve experiment: error: 1 KV blocks per replica (0.01 of the 48-block working set) cannot hold the "
        "longest request (152 tokens = 10 blocks); give --kv-fraction 0.21 or more, or --kv-blocks-per-replica"
    )
    # The fraction it names is enough: 0.21 x 48 blocks, rounded up, is 11.
    args = parse([*TINY, "--qps", "1", "--kv-fraction", "0.21", "--policies", "round_robin", "--no-plots",
                  "--out", str(tmp_path / "b")])
    assert run_experiment(args) == 0
    assert "3 replicas x 11 KV blocks" in capsys.readouterr().out


def run_bad(argv: list[str], capsys) -> str:  # noqa: ANN001
    """The one-line error of a setup that must fail with exit status 2."""
    assert run_experiment(parse(argv)) == 2
    return error_line(capsys.readouterr().err)


def error_line(err: str) -> str:
    """The last line of ``err``: the only error, after progress lines if any, and no traceback."""
    *before, last = err.strip().splitlines()
    assert "Traceback" not in err and not any(line.startswith("kvserve experiment:") for line in before), err
    return last + "\n"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--qps", "1,,2"], "--qps must be comma-separated numbers"),
        (["--qps", "1,1"], "--qps rates must differ"),
        (["--qps", "0"], "--qps rates must be finite numbers > 0"),
        (["--qps", "inf"], "--qps rates must be finite numbers > 0, got 'inf'"),
        (["--qps", "knee", "--knee-factor", "0"], "--knee-factor must be a number > 1"),
        (["--qps", "5", "--knee-factor", "3"], "--knee-factor is for --qps knee"),
        (["--qps", "1", "--block-size", "0"], "--block-size must be >= 1"),
        (["--qps", "1", "--block-size", "-16"], "--block-size must be >= 1"),
        (["--qps", "1", "--kv-fraction", "inf"], "--kv-fraction must be a positive number"),
        (["--qps", "1", "--seed", "-1"], "--seed must be >= 0"),
        (["--qps", "1", "--kv-blocks-per-replica", "-5"], "--kv-blocks-per-replica must be >= 1, got -5"),
        (["--qps", "1", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--qps", "1", "--sim-processes", "0"], "--sim-processes must be >= 1, got 0"),
        (["--qps", "1", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
        (["--qps", "1", "--policies", ""], "--policies names no policy"),
        (["--qps", "1", "--policies", " , "], "--policies names no policy"),
        (["--qps", "1", "--policies", "cache_aware,round_robin,cache_aware"], "--policies names cache_aware more"),
        (["--qps", "1", "--burstiness", "nan"], "--burstiness must be a positive number"),
        (["--qps", "1", "--baseline", "cache_aware", "--policies", "round_robin"], "--baseline cache_aware is not"),
        (["--qps", "1", "--trace", "trace.jsonl"], "--trace is for the mooncake workload"),
        (["--qps", "1", "--workload-arg", "seed=1"], "--workload-arg seed: use --seed"),
        (["--qps", "1", "--workload-arg", "burstiness=2"], "--workload-arg burstiness: use --burstiness"),
        (["--qps", "1", "--workload-arg", "num_requests=3"], "--workload-arg num_requests: use --num-requests"),
        (["--qps", "1", "--workload-arg", "qps=3"], "--workload-arg qps: use --qps"),
        (["--qps", "1", "--workload-arg", "zipf_exponent=nan"], "zipf_exponent must be a finite number"),
        (["--qps", "1", "--workload-arg", "num_tenants=2.5"], "num_tenants must be an integer"),
        # --policy-arg refuses a repeated key; so does --workload-arg, which took the last silently.
        (["--qps", "1", "--workload-arg", "num_groups=8"], "--workload-arg num_groups is given more than once"),
    ],
)
def test_bad_options_are_reported_before_the_output_folder_is_made(tmp_path, capsys, extra, message) -> None:  # noqa: ANN001
    out = tmp_path / "run"

    assert message in run_bad([*TINY, *extra, "--out", str(out)], capsys)
    assert not out.exists()


def test_an_empty_out_is_refused_rather_than_taken_as_the_current_directory(capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as exit_info:
        parse([*TINY, "--qps", "1", "--out", ""])

    assert exit_info.value.code == 2
    assert "--out: must name a directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policy-arg", "cache_aware.bogus=1"], "--policy-arg cache_aware: bad arguments"),
        (["--policy-arg", "cache_aware.=1"], "--policy-arg must be POLICY.KEY=VALUE"),
        (["--policy-arg", "cache_aware"], "--policy-arg must be POLICY.KEY=VALUE, got 'cache_aware'"),
        (["--policy-arg", "cache_aware.cache_threshold=abc"], "--policy-arg cache_aware: "),
        (["--policy-arg", "cache_aware.cache_threshold=-5"], "--policy-arg cache_aware: "),
        (["--policy-arg", "cost_ttft.cost_model=1"], "the experiment sets it from --cost-model"),
        (["--policy-arg", "least_loaded.seed=1"], "the experiment sets it from --seed"),
        (["--policy-arg", "consistent_hash.load_factor=2", "--policies", "round_robin"], "consistent_hash is not run"),
        (["--policy-arg", "round_robin.x=1", "--jobs", "2"], "--policy-arg round_robin: bad arguments"),
        (
            ["--policy-arg", "cache_aware.cache_threshold=0.5", "--policy-arg", "cache_aware.cache_threshold=0.6"],
            "--policy-arg cache_aware.cache_threshold is given more than once",
        ),
    ],
)
def test_every_policy_is_built_before_the_first_run(tmp_path, capsys, extra, message) -> None:  # noqa: ANN001
    out = tmp_path / "run"
    policies = [] if "--policies" in extra else ["--policies", "round_robin,least_loaded,cache_aware,cost_ttft"]

    assert message in run_bad([*TINY, *policies, "--qps", "1,2", *extra, "--out", str(out)], capsys)
    assert not out.exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file, nor a measured cost model of that name (llama-3-8b-h100)"),
        ("", "cost model is not JSON"),
        ("[1, 2]", "must be an object"),
        ('{"a": 0.01}', "lacks ['b', 'c', 'd']"),
        ('{"a": "fast", "b": 0, "c": 0, "d": 0}', "coefficient a must be a number"),
        ('{"a": true, "b": 0, "c": 0, "d": 0}', "coefficient a must be a number"),
        ('{"a": -0.01, "b": 0, "c": 0, "d": 0}', "coefficient a must be finite and >= 0"),
        ('{"a": NaN, "b": 0, "c": 0, "d": 0}', "coefficient a must be finite and >= 0"),
        ('{"a": 0, "b": 0, "c": 0, "d": 0}', "must not all be zero"),
    ],
)
def test_a_bad_cost_model_file_is_reported_without_a_traceback(tmp_path, capsys, content, message) -> None:  # noqa: ANN001
    path = tmp_path / "cost.json"
    if content is not None:
        path.write_text(content)

    err = run_bad([*TINY, "--qps", "1", "--cost-model", str(path), "--out", str(tmp_path / "run")], capsys)
    assert f"--cost-model {path}: " in err and message in err


def test_a_measured_cost_model_is_named_without_its_path(tmp_path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "run"
    args = parse([*TINY, "--sim", "--policies", "round_robin", "--qps", "5", "--no-plots",
                  "--cost-model", "llama-3-8b-h100", "--out", str(out)])
    assert run_experiment(args) == 0
    captured = capsys.readouterr()
    assert "step cost: a=0.0114 s, b=6.47e-05 s/prefill token, c=0.000117 s/decode, d=0" in captured.out + captured.err


def test_a_cost_model_beyond_the_virtual_clock_is_reported_without_a_traceback(tmp_path, capsys) -> None:  # noqa: ANN001
    # Steps of 1e308 s: the clock reached inf, and the table was nan with exit status 0.
    path = tmp_path / "cost.json"
    path.write_text('{"a": 1e308, "b": 0, "c": 0, "d": 0}')

    err = run_bad([*TINY, "--qps", "1", "--policies", "round_robin", "--cost-model", str(path), "--no-plots",
                   "--out", str(tmp_path / "run")], capsys)
    assert err.startswith("kvserve experiment: error: round_robin @ 1 qps: the virtual clock cannot count a 1e+308 s step")


@pytest.mark.parametrize(
    "extra",
    [
        ["--policy-arg", "cache_aware.cache_threshold=2"],
        ["--policies", "cache_aware,round_robin", "--out", "FILE/run"],
    ],
)
def test_options_are_checked_before_the_stream_is_generated(tmp_path, capsys, monkeypatch, extra) -> None:  # noqa: ANN001
    # A long stream takes a minute or more to generate: a typo was reported after it.
    def generate(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        raise AssertionError("the stream was generated")

    monkeypatch.setattr(experiment.StreamSpec, "at", generate)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    argv = [*TINY, "--qps", "1", "--policies", "cache_aware", "--out", str(tmp_path / "run"), *extra]

    assert run_bad([arg.replace("FILE", str(a_file)) for arg in argv], capsys).startswith("kvserve experiment: error: ")


def test_the_memory_check_counts_the_fleets_that_run_at_once_not_the_jobs(tmp_path, capsys, monkeypatch) -> None:  # noqa: ANN001
    # 2 runs with --jobs 1000 build 2 fleets at once, not 1000.
    monkeypatch.setattr(experiment, "available_memory_bytes", lambda: 3 * 3 * 101 * FLEET_BYTES_PER_BLOCK)
    argv = [*TINY, "--qps", "1", "--policies", "round_robin,cache_aware", "--kv-blocks-per-replica", "100",
            "--no-plots", "--out", str(tmp_path / "run")]

    assert run_experiment(parse([*argv, "--jobs", "1000"])) == 0
    assert "(4 parallel jobs at once)" in run_bad([*argv, "--qps", "1,2", "--jobs", "1000"], capsys)


def test_the_infinite_cache_reference_is_computed_once_per_rate_and_said(tmp_path, capsys, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(experiment_runs, "QUIET_SECONDS", 0.0)  # every stage said, however quick
    args = parse([*TINY, "--qps", "1,2", "--policies", "round_robin", "--no-plots", "--out", str(tmp_path / "run")])

    assert run_experiment(args) == 0
    err = capsys.readouterr().err
    # The reference at 1 qps sized the fleet: it is reused, not recomputed.
    assert "infinite-cache hit rate at 2 qps" in err and "infinite-cache hit rate at 1 qps" not in err


def test_a_traces_rate_is_reported_to_four_significant_digits() -> None:
    # One request an hour was reported as 0 qps (rounded to 3 decimals).
    hourly = [WorkloadRequest(arrival_time=3600.0 * i, prompt_token_ids=[5] * 4, output_len=1) for i in range(3)]

    assert qps_label(None, hourly) == 0.0002778
    assert qps_label(2.5, hourly) == 2.5


def test_an_out_that_is_a_file_or_under_one_is_reported(tmp_path, capsys) -> None:  # noqa: ANN001
    a_file = tmp_path / "a_file"
    a_file.write_text("")

    assert "is not a directory" in run_bad([*TINY, "--qps", "1", "--out", str(a_file)], capsys)
    # Before the stream is generated (a minute or more for a long one).
    assert f"--out {a_file}/sub/run: {a_file} is not a directory" in run_bad(
        [*TINY, "--qps", "1", "--out", str(a_file / "sub" / "run")], capsys
    )


@pytest.mark.parametrize("think_time", ["inf", "nan", "-1"])
@pytest.mark.parametrize("workload", ["multi_turn", "customer_contexts", "agent_tools"])
def test_a_session_workload_rejects_a_think_time_that_is_not_finite(tmp_path, capsys, workload, think_time) -> None:  # noqa: ANN001
    argv = ["--workload", workload, "--workload-arg", f"think_time={think_time}", "--replicas", "2",
            "--num-requests", "20", "--qps", "1", "--out", str(tmp_path / "run")]

    assert "think_time must be a finite number >= 0" in run_bad(argv, capsys)


def test_a_knee_search_past_the_rates_a_session_workload_can_generate_ends_with_an_error(
    tmp_path, capsys, monkeypatch  # noqa: ANN001
) -> None:
    # 1.5 s of warm-up x (4 turns + 1) = 7.5 turns generated per qps, and 20
    # measured: the doubling search (2, 4, 8, 16 qps) passes the limit of 100
    # at 16 qps.
    monkeypatch.setattr(sessions, "MAX_GENERATED_TURNS", 100)
    argv = ["--workload", "multi_turn", *(f"--workload-arg={arg}" for arg in (
        "system_prompt_len=8", "user_len=4", "answer_len=4", "think_time=1", "min_turns=2", "max_turns=4")),
        "--replicas", "2", "--kv-blocks-per-replica", "64", "--num-requests", "20",
        "--qps", "knee", "--knee-factor", "1000", "--policies", "round_robin", "--no-plots", "--out", str(tmp_path / "run")]

    assert run_experiment(parse(argv)) == 2
    err = capsys.readouterr().err

    assert "Traceback" not in err and "knee: 8 qps ->" in err
    assert err.strip().splitlines()[-1].startswith(
        "kvserve experiment: error: --qps knee: --workload multi_turn at 16 qps: the stream needs about 140 turns"
    )


def test_a_stream_too_big_for_memory_is_reported_without_a_traceback(tmp_path, capsys) -> None:  # noqa: ANN001
    # 1e15 arrival times alone are 8 PB: the allocation fails at once, past any address space.
    argv = [*TINY_WORKLOAD, "--replicas", "2", "--num-requests", str(10**15), "--qps", "1", "--no-plots",
            "--out", str(tmp_path / "run")]

    assert run_experiment(parse(argv)) == 1
    err = error_line(capsys.readouterr().err)

    assert err.startswith("kvserve experiment: error: out of memory (")
    assert err.strip().endswith("a shorter stream (--num-requests) or a smaller fleet needs less")


def test_a_fleet_is_refused_when_its_blocks_would_not_fit_in_the_available_memory() -> None:
    fleet = FleetConfig(
        num_replicas=10, scheduler_config=SchedulerConfig(max_model_len=64),
        cache_config=CacheConfig(block_size=16, num_blocks=101), cost_model=StepCostModel.default(),
    )
    needed = 10 * 101 * FLEET_BYTES_PER_BLOCK

    check_fleet_memory(fleet, 1, needed)
    check_fleet_memory(fleet, 4, None)  # unknown: nothing to check against
    with pytest.raises(ExperimentError, match=r"^10 replicas x 101 KV blocks need at least 0.1 MB to simulate \(120 bytes a block before any request\), more than the 0.1 MB"):
        check_fleet_memory(fleet, 1, needed - 1)
    with pytest.raises(ExperimentError, match=r"\(2 parallel jobs at once\) .* or fewer --jobs$"):
        check_fleet_memory(fleet, 2, 2 * needed - 1)


def test_a_fleet_far_too_big_for_the_machine_is_refused_before_anything_is_built(tmp_path, capsys) -> None:  # noqa: ANN001
    # A million replicas of a million blocks: at least 120 TB, past any machine's memory.
    argv = [*TINY_WORKLOAD, "--replicas", str(10**6), "--kv-blocks-per-replica", str(10**6), "--num-requests", "20",
            "--qps", "1",
            "--out", str(tmp_path / "run")]

    err = run_bad(argv, capsys)

    assert err.startswith("kvserve experiment: error: 1,000,000 replicas x 1,000,001 KV blocks need at least 120,000.1 GB")
    assert not (tmp_path / "run").exists()


def write_trace(path: Path, timestamps: list[int]) -> None:
    path.write_text("".join(
        json.dumps({"timestamp": t, "input_length": 40, "output_length": 4, "hash_ids": [i % 2]}) + "\n"
        for i, t in enumerate(timestamps)
    ))


def trace_args(trace: Path, out: Path) -> list[str]:
    return ["--workload", "mooncake", "--trace", str(trace), "--replicas", "2", "--kv-blocks-per-replica", "16",
            "--policies", "round_robin", "--no-plots", "--out", str(out)]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--qps", "1", "--workload-arg", "block_tokens=0"], "block_tokens must be an integer >= 1"),
        (["--qps", "1", "--workload-arg", "block_tokens=-4"], "block_tokens must be an integer >= 1"),
        (["--qps", "trace", "--burstiness", "0.5"], "--burstiness does not apply to a trace"),
        # It was taken: every record a warm-up, then a traceback ("cannot summarise a run without requests").
        (["--qps", "trace", "--workload-arg", "warmup_fraction=1"], "--workload-arg warmup_fraction must be below 1"),
    ],
)
def test_bad_trace_settings_are_reported(tmp_path, capsys, extra, message) -> None:  # noqa: ANN001
    write_trace(tmp_path / "trace.jsonl", [0, 100, 200])

    assert message in run_bad([*trace_args(tmp_path / "trace.jsonl", tmp_path / "run"), *extra], capsys)


def test_a_trace_run_reports_the_requests_it_has_not_the_default_count(tmp_path, capsys) -> None:  # noqa: ANN001
    write_trace(tmp_path / "trace.jsonl", [0, 300, 100, 200, 400])

    assert run_experiment(parse([*trace_args(tmp_path / "trace.jsonl", tmp_path / "run"), "--qps", "trace"])) == 0

    printed = capsys.readouterr().out
    assert "workload mooncake" in printed and ": 5 requests, seed 0" in printed
    assert "mooncake (simulated): 5 requests, 2 replicas" in printed


def test_a_failed_run_leaves_no_result_files_of_an_earlier_one(tmp_path, capsys, monkeypatch) -> None:  # noqa: ANN001
    out = tmp_path / "run"
    out.mkdir()
    for name in experiment.RESULT_FILES:
        (out / name).write_text("an earlier run")

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(experiment_runs, "simulate_all", interrupted)

    assert run_experiment(parse([*TINY, "--qps", "1", "--out", str(out)])) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "kvserve experiment: interrupted"
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


def _interrupt_the_parent(pid_dir: Path, signum: int, *run: object) -> None:
    # Each worker leaves its pid, and which stop signals it ignores (a group's Ctrl-C or SIGTERM).
    ignored = [name for name in ("SIGINT", "SIGTERM") if signal.getsignal(getattr(signal, name)) is signal.SIG_IGN]
    # Written elsewhere and renamed: the parent may kill it at any point, and a pid file is whole.
    draft = pid_dir.parent / f"{os.getpid()}.draft"
    draft.write_text(" ".join(ignored))
    draft.rename(pid_dir / str(os.getpid()))
    parent = os.getppid()
    try:  # the first worker only: one Ctrl-C (or SIGTERM)
        os.close(os.open(pid_dir.parent / "interrupted", os.O_CREAT | os.O_EXCL))
        os.kill(parent, signum)
    except FileExistsError:
        pass
    end = time.monotonic() + 600
    while time.monotonic() < end and os.getppid() == parent:  # ten minutes, unless orphaned
        time.sleep(0.1)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_the_worker_processes_of_jobs(tmp_path, capsys, monkeypatch, signum) -> None:  # noqa: ANN001
    # One worker (a fork of this process) interrupts its parent; both would run for ten minutes.
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    monkeypatch.setattr(experiment_runs, "run_one", functools.partial(_interrupt_the_parent, pid_dir, signum))
    sigterm_handler = signal.getsignal(signal.SIGTERM)
    args = parse([*TINY, "--policies", "round_robin,cache_aware", "--qps", "1", "--jobs", "2",
                  "--out", str(tmp_path / "run")])
    start = time.monotonic()

    assert run_experiment(args) == 130

    assert time.monotonic() - start < 300  # far from the workers' ten minutes, even on a loaded machine
    assert not multiprocessing.active_children()
    workers = [int(path.name) for path in pid_dir.iterdir()]
    assert workers
    assert all(path.read_text() == "SIGINT SIGTERM" for path in pid_dir.iterdir())
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # stopped and reaped
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "kvserve experiment: interrupted"
    assert signal.getsignal(signal.SIGTERM) is sigterm_handler  # the caller's again


def _killed(*run: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer ends a process


def test_a_worker_killed_from_outside_is_reported_without_a_traceback(tmp_path, capsys, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(experiment_runs, "run_one", _killed)
    args = parse([*TINY, "--policies", "round_robin,cache_aware", "--qps", "1", "--jobs", "2", "--no-plots",
                  "--out", str(tmp_path / "run")])

    assert run_experiment(args) == 2

    assert not multiprocessing.active_children()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        "kvserve experiment: error: a simulation worker died (killed, most likely for memory: 2 fleets of 3 replicas x "
    )
    assert not (tmp_path / "run" / "summary.md").exists()


def test_a_file_written_atomically_is_absent_until_complete(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "summary.md"
    with pytest.raises(RuntimeError), atomic_open(path) as file:
        file.write("half a table")
        raise RuntimeError("disk full")

    assert list(tmp_path.iterdir()) == []
    with atomic_open(path) as file:
        file.write("a table")
    assert path.read_text() == "a table" and list(tmp_path.iterdir()) == [path]


def test_a_trace_is_replayed_whole_unless_num_requests_cuts_it(tmp_path, capsys) -> None:  # noqa: ANN001
    # More records than the default count for 2 replicas (2,000): all of them run.
    write_trace(tmp_path / "trace.jsonl", list(range(0, 2100 * 10, 10)))
    args = trace_args(tmp_path / "trace.jsonl", tmp_path / "run")

    assert run_experiment(parse([*args, "--qps", "trace"])) == 0
    assert "mooncake (simulated): 2,100 requests" in capsys.readouterr().out
    assert run_experiment(parse([*args, "--qps", "trace", "--num-requests", "50"])) == 0
    assert "mooncake (simulated): 50 requests" in capsys.readouterr().out


def test_a_trace_of_one_instant_is_replayed_as_recorded_but_not_rescaled(tmp_path, capsys) -> None:  # noqa: ANN001
    write_trace(tmp_path / "trace.jsonl", [500] * 6)
    args = trace_args(tmp_path / "trace.jsonl", tmp_path / "run")

    assert run_experiment(parse([*args, "--qps", "trace"])) == 0
    capsys.readouterr()
    message = run_bad([*args, "--qps", "2,20"], capsys)
    assert "mooncake at 2 qps: " in message and "has no time span to rescale to 2 qps (6 requests" in message


def test_a_stream_without_reused_prefixes_needs_a_cache_size_and_compares_to_no_hit_rate(tmp_path, capsys) -> None:  # noqa: ANN001
    # Every record its own block: an infinite cache would hit nothing.
    (tmp_path / "trace.jsonl").write_text("".join(
        json.dumps({"timestamp": 10 * i, "input_length": 40, "output_length": 4, "hash_ids": [i]}) + "\n"
        for i in range(20)
    ))
    args = [arg for arg in trace_args(tmp_path / "trace.jsonl", tmp_path / "run")]
    sized = args.index("--kv-blocks-per-replica")
    unsized = args[:sized] + args[sized + 2:]

    message = run_bad([*unsized, "--qps", "trace", "--kv-fraction", "1000"], capsys)
    assert "the stream reuses no prefix" in message and "give --kv-blocks-per-replica" in message
    assert run_experiment(parse([*args, "--qps", "trace"])) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| round_robin"))
    assert [cell.strip() for cell in row.split("|")][3:5] == ["0.000", "-"]
    with open(tmp_path / "run" / "summary.csv") as f:
        assert next(csv.DictReader(f))["hit_vs_infinite"] == ""


def test_every_rates_stream_is_fitted_before_the_first_run(tmp_path, capsys) -> None:  # noqa: ANN001
    # At 1 qps the longest request fits 210 blocks; at 5 qps one session's history does not.
    message = run_bad(["--workload", "multi_turn", "--replicas", "2", "--num-requests", "10", "--qps", "1,5,20",
                       "--kv-blocks-per-replica", "210", "--no-plots", "--out", str(tmp_path / "run")], capsys)

    assert "multi_turn at 5 qps: 210 KV blocks per replica cannot hold the longest request" in message
    assert not (tmp_path / "run" / "requests.csv").exists()


def test_a_cache_fraction_too_small_for_a_higher_rates_stream_names_the_least_that_fits(tmp_path, capsys) -> None:  # noqa: ANN001
    # At 3 qps a session's history outgrows the cache sized at 1 qps: the error said only "raise --kv-fraction".
    # The caches are sized on the default stream (2,000 requests at 1 qps: 40,770 blocks reused), and
    # 0.006 of it (245 blocks) holds the run's stream at 1 qps, whose longest request is shorter.
    argv = ["--workload", "multi_turn", "--replicas", "2", "--num-requests", "1", "--qps", "3", "--no-plots",
            "--policies", "round_robin"]
    message = run_bad([*argv, "--kv-fraction", "0.006", "--out", str(tmp_path / "run")], capsys)

    assert message.strip().endswith(
        "multi_turn at 3 qps: 245 KV blocks per replica (0.006 of the 40770-block working set) cannot hold the "
        "longest request (4096 tokens = 256 blocks); give --kv-fraction 0.0063 or more, or --kv-blocks-per-replica"
    )
    # The fraction it names is enough: 0.0063 x 40,770 blocks, rounded up, is 257.
    assert run_experiment(parse([*argv, "--kv-fraction", "0.0063", "--out", str(tmp_path / "enough")])) == 0
    assert "2 replicas x 257 KV blocks" in capsys.readouterr().out


def sized_blocks(out: Path) -> tuple[int, int | None]:
    """A finished run's KV blocks per replica, and the working set ``--kv-fraction`` sized them on."""
    config = json.loads((out / "config.json").read_text())
    return config["kv_blocks_per_replica_used"], config["sizing_working_set_blocks"]


def test_num_requests_sets_how_long_a_run_measures_not_the_replicas_caches(tmp_path, capsys) -> None:  # noqa: ANN001
    # A session workload's working set is every history of the stream: sized on the run's own stream,
    # 30 requests gave caches a tenth of the default run's, too small for the sessions under way (hit
    # rate 0.16 of an infinite cache's, TTFT p50 12 s).
    argv = ["--workload", "multi_turn", "--replicas", "2", "--qps", "5", "--policies", "cost_ttft", "--no-plots"]
    default_stream = sessions_reference(2_000)
    assert run_experiment(parse([*argv, "--num-requests", "30", "--out", str(tmp_path / "short")])) == 0

    printed = capsys.readouterr().out
    assert "caches sized on the stream at 1 qps with 2,000 requests, the default for 2 replicas" in printed
    expected = -(-default_stream.num_reused_blocks // 4)  # a quarter, rounded up
    assert sized_blocks(tmp_path / "short") == (expected, default_stream.num_reused_blocks)
    assert f"2 replicas x {expected} KV blocks" in printed
    # The run's own stream reuses far fewer blocks: what the caches were sized on before.
    assert sessions_reference(30).num_reused_blocks < default_stream.num_reused_blocks / 10
    row = next(line for line in printed.splitlines() if line.startswith("| cost_ttft"))
    assert float(row.split("|")[4]) >= 0.9  # hit rate against an infinite cache's

    assert run_experiment(parse([*argv, "--num-requests", "60", "--kv-fraction", "0.5",
                                 "--out", str(tmp_path / "half")])) == 0
    half = -(-default_stream.num_reused_blocks // 2)
    assert sized_blocks(tmp_path / "half") == (half, default_stream.num_reused_blocks)
    assert "caches sized on" in capsys.readouterr().out
    # Given outright, nothing is sized on a stream.
    assert run_experiment(parse([*argv, "--num-requests", "30", "--kv-blocks-per-replica", "4000",
                                 "--out", str(tmp_path / "given")])) == 0
    assert sized_blocks(tmp_path / "given") == (4000, None)
    assert "caches sized on" not in capsys.readouterr().out


def sessions_reference(num_requests: int) -> CacheReference:
    """The infinite-cache reference of multi-turn chat (seed 0) at 1 qps."""
    return infinite_cache_reference(make_workload("multi_turn", num_requests, 1.0, seed=0), 16)


def test_a_trace_cut_short_gets_the_caches_of_the_whole_trace(tmp_path, capsys) -> None:  # noqa: ANN001
    # Blocks of 16 tokens, as the KV cache's: the first 4 records reuse 1 block, the whole trace 3.
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": 100 * i, "input_length": 16 * len(ids), "output_length": 4, "hash_ids": ids}) + "\n"
        for i, ids in enumerate([[0, 1], [0, 2], [0, 3], [0, 4], [5, 6, 7], [5, 6, 8], [5, 6, 9]])
    ))
    argv = ["--workload", "mooncake", "--trace", str(trace), "--workload-arg", "block_tokens=16", "--replicas", "2",
            "--qps", "trace", "--kv-fraction", "2", "--policies", "round_robin", "--no-plots"]

    assert run_experiment(parse([*argv, "--out", str(tmp_path / "whole")])) == 0
    assert sized_blocks(tmp_path / "whole") == (6, 3)
    # More requests than records: the whole trace runs, on the caches sized on it, as it says.
    assert run_experiment(parse([*argv, "--num-requests", "100", "--out", str(tmp_path / "more")])) == 0
    assert sized_blocks(tmp_path / "more") == (6, 3)
    assert "caches sized on" not in capsys.readouterr().out
    # Sized on its own 1 block, the cut trace's caches (2 blocks) could not hold its requests (3 blocks).
    assert run_experiment(parse([*argv, "--num-requests", "4", "--out", str(tmp_path / "cut")])) == 0
    assert sized_blocks(tmp_path / "cut") == (6, 3)
    assert "caches sized on the stream as recorded with all its records" in capsys.readouterr().out
    assert json.loads((tmp_path / "cut" / "config.json").read_text())["prefix_working_set_blocks"] == 1


def test_the_knees_baseline_gets_a_row_and_the_knee_is_recorded(tmp_path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "run"
    assert run_experiment(parse([*TINY, "--policies", "cache_aware", "--qps", "knee", "--no-plots",
                                 "--out", str(out)])) == 0

    printed = capsys.readouterr().out
    assert "baseline round_robin" in printed
    with open(out / "summary.csv") as f:
        summary = list(csv.DictReader(f))
    assert [s["policy"] for s in summary] == ["cache_aware", "round_robin"]
    config = json.loads((out / "config.json").read_text())
    assert config["knee_qps"] == float(summary[0]["qps"])
    assert config["sim"] is True  # the default mode, without --sim
    # The defaults it applied, as values rather than null.
    assert (config["burstiness"], config["kv_fraction"], config["knee_factor"]) == (1.0, 0.25, 5.0)


def test_a_reader_of_stdout_that_stops_early_loses_no_result_file(tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "run"
    command = [sys.executable, "-u", "-m", "kvserve.experiments.experiment", *TINY, "--policies", "round_robin,cost_ttft",
               "--qps", "5,20", "--out", str(out)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline()  # as `| head -1` does
    process.stdout.close()
    _, err = process.communicate(timeout=120)

    assert process.returncode == 128 + signal.SIGPIPE, err
    assert "Traceback" not in err and "BrokenPipeError" not in err
    for name in ("requests.csv", "summary.csv", "summary.md", "hit_rate_vs_qps.png", "ttft_p99_vs_qps.png"):
        assert (out / name).is_file()


def test_the_setup_says_when_a_replica_cache_holds_only_a_few_requests(tmp_path, capsys) -> None:  # noqa: ANN001
    # A quarter of the tiny working set (48 blocks) holds one request of 10 blocks.
    assert run_experiment(parse([*TINY, "--policies", "round_robin", "--qps", "5", "--no-plots",
                                 "--out", str(tmp_path / "small")])) == 0
    assert "holds only 1 of the longest requests at once" in capsys.readouterr().out

    assert run_experiment(parse([*TINY, "--policies", "round_robin", "--qps", "5", "--no-plots",
                                 "--kv-blocks-per-replica", "40", "--out", str(tmp_path / "large")])) == 0
    assert "of the longest requests at once" not in capsys.readouterr().out


def test_a_session_stream_with_longer_requests_than_at_1_qps_still_runs(tmp_path, capsys) -> None:  # noqa: ANN001
    # The fleet is sized on the stream at 1 qps (longest request 3,712 tokens); at 10 qps more
    # sessions are under way and one reaches 4,096: every run is fitted to its own stream.
    args = parse(["--workload", "multi_turn", "--replicas", "2", "--num-requests", "80", "--qps", "10",
                  "--policies", "cache_aware", "--kv-blocks-per-replica", "2000", "--no-plots",
                  "--out", str(tmp_path / "run")])

    assert run_experiment(args) == 0
    with open(tmp_path / "run" / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert max(int(r["num_prompt_tokens"]) + int(r["num_output_tokens"]) for r in rows) == 4096


def test_a_live_experiment_runs_at_the_default_time_scale_unless_told() -> None:
    live = parse([*TINY, "--live", "--qps", "1", "--out", "unused"])
    check_live_options(live)
    assert live.time_scale == DEFAULT_TIME_SCALE == 5.0

    told = parse([*TINY, "--live", "--time-scale", "2", "--qps", "1", "--out", "unused"])
    check_live_options(told)
    assert told.time_scale == 2.0


def test_a_workload_whose_requests_are_all_a_warm_up_is_refused_before_it_runs(tmp_path, capsys, monkeypatch) -> None:  # noqa: ANN001
    # A workload of one's own (experiments/README.md) whose warm-up outnumbers its requests.
    from kvserve.experiments.workloads.registry import WORKLOADS

    def warm_up_only(num_requests, qps, *, seed=0, burstiness=1.0, vocab_size=32_000):  # noqa: ANN001, ANN202
        return [WorkloadRequest(i / qps, [3 + i, 4, 5, 6], 4, measured=False) for i in range(num_requests)]

    monkeypatch.setitem(WORKLOADS, "warm_up_only", warm_up_only)
    out = tmp_path / "run"
    err = run_bad(["--workload", "warm_up_only", "--sim", "--replicas", "2", "--num-requests", "5", "--qps", "1",
                   "--no-plots", "--out", str(out)], capsys)

    assert err == (
        "kvserve experiment: error: every one of the workload's 5 requests is a warm-up: none would be measured "
        "(more --num-requests, or a shorter warm-up through --workload-arg)\n"
    )
    assert not (out / "summary.md").exists()


def test_a_bad_workload_value_names_its_workload_arg_not_the_rate_it_was_generated_at(tmp_path, capsys, monkeypatch) -> None:  # noqa: ANN001
    # It said "--workload shared_prefix at 1 qps: ..." (the stream that sizes the caches) for --qps 2.
    err = run_bad([*TINY, "--qps", "2", "--workload-arg", "num_tenants=2.5", "--out", str(tmp_path / "a")], capsys)
    assert err == "kvserve experiment: error: --workload-arg num_tenants must be an integer >= 0, got 2.5\n"

    # A workload of one's own (experiments/README.md's) got the text and failed inside numpy.
    from kvserve.experiments.workloads.registry import WORKLOADS

    def two_prefixes(num_requests, qps, *, seed=0, burstiness=1.0, prefix_len=1024):  # noqa: ANN001, ANN202
        return [WorkloadRequest(float(i), [3] * (prefix_len * 2) + [4 + i], 4) for i in range(num_requests)]

    monkeypatch.setitem(WORKLOADS, "two_prefixes", two_prefixes)
    err = run_bad(["--workload", "two_prefixes", "--replicas", "2", "--num-requests", "5", "--qps", "1",
                   "--workload-arg", "prefix_len=abc", "--out", str(tmp_path / "b")], capsys)
    assert err == "kvserve experiment: error: --workload-arg prefix_len must be a number (its default is 1024), got 'abc'\n"
