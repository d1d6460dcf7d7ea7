"""``kvserve experiment --sim`` on a tiny run: files, table, same stream for every policy."""

from __future__ import annotations

import argparse
import csv

import pytest

from kvserve.bench.experiment import add_experiment_parser, run_experiment
from kvserve.bench.experiment_setup import default_num_requests


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_experiment_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["experiment", *argv])


TINY_WORKLOAD = [
    "--workload", "shared_prefix", "--workload-arg", "num_groups=6", "--workload-arg", "system_prompt_len=128",
    "--workload-arg", "question_len=16", "--workload-arg", "output_len=8",
]
TINY = [*TINY_WORKLOAD, "--replicas", "3", "--num-requests", "80"]


def test_a_tiny_experiment_writes_requests_summary_and_plots(tmp_path, capsys) -> None:  # noqa: ANN001
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
    assert len(rows) == 3 * 2 * 80
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
        assert sum(1 for _ in csv.DictReader(f)) == 2250


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


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--sim", "--address", "auto"], "--address only apply to --live"),
        (["--time-scale", "2"], "--time-scale only apply to --live"),
        (["--model", "/nonexistent/model"], "--model only apply to --live"),
        (["--live", "--jobs", "2"], "--jobs is for simulations"),
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
    ],
)
def test_bad_setups_are_reported_without_a_traceback(tmp_path, capsys, extra, message) -> None:  # noqa: ANN001
    args = parse([*TINY, *extra, "--out", str(tmp_path)])

    assert run_experiment(args) == 2
    assert message in capsys.readouterr().err
