"""How ``kvserve experiment`` reports: milliseconds for TTFT, lines that stay apart, what does not combine."""

from __future__ import annotations

import argparse
import collections
import csv

import pytest

from kvserve.experiments.experiment import add_experiment_parser
from kvserve.experiments.experiment_report import (
    SUMMARY_HEADERS,
    RunSummary,
    plot_summaries,
    replayed_counts,
    summary_rows,
)


def summary(policy: str, qps: float, ttft_p99: float) -> RunSummary:
    return RunSummary(
        workload="shared_prefix", num_replicas=8, qps=qps, policy=policy, num_requests=100, hit_rate=0.9,
        infinite_hit_rate=0.91, hit_vs_infinite=0.99, ttft_p50=0.019412, ttft_p99=ttft_p99, e2e_p50=2.2,
        e2e_p99=2.6, throughput=7474.0, load_imbalance=1.1, busy_imbalance=1.0, num_preemptions=0, wall_seconds=1.0,
    )


def test_ttft_is_printed_in_milliseconds_with_digits_that_tell_close_policies_apart() -> None:
    rows = summary_rows([summary("cache_aware", 29.66, 0.13358), summary("cost_ttft", 29.66, 0.13056)], "cache_aware")
    headers = list(SUMMARY_HEADERS)
    p50, p99 = headers.index("TTFT p50 ms"), headers.index("TTFT p99 ms")
    assert [row[p99] for row in rows] == ["133.58", "130.56"]
    assert rows[0][p50] == "19.41"


def test_each_policy_line_has_its_own_marker_and_dash_pattern(tmp_path, monkeypatch) -> None:
    import matplotlib.axes

    drawn = []
    original = matplotlib.axes.Axes.plot

    def recording_plot(self, *args, **kwargs):
        drawn.append((kwargs.get("label"), kwargs.get("marker"), kwargs.get("linestyle")))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording_plot)
    policies = ["round_robin", "least_loaded", "consistent_hash", "cache_aware", "cost_ttft"]
    summaries = [summary(p, q, 0.1 + i / 1000) for i, p in enumerate(policies) for q in (10.0, 20.0)]
    paths = plot_summaries(summaries, tmp_path)
    assert all(path.stat().st_size > 0 for path in paths)
    ttft_lines = [(marker, style) for label, marker, style in drawn[len(drawn) // 2 :] if label in policies]
    assert len(ttft_lines) == len(policies)
    assert len(set(ttft_lines)) == len(policies)  # no two policies look alike


def test_help_names_the_options_that_do_not_combine(capsys) -> None:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_experiment_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["experiment", "--help"])
    text = capsys.readouterr().out
    assert "options that do not combine:" in text
    assert "--qps knee            not with the mooncake workload" in text
    assert "--jobs, --sim-processes             only for simulations (not --live)" in text


def test_the_table_header_says_how_many_requests_were_replayed_and_how_many_measured(tmp_path, capsys) -> None:
    from kvserve.experiments.experiment import run_experiment
    from tests.experiments.test_experiment import parse

    argv = ["--workload", "multi_turn", "--replicas", "2", "--qps", "5", "--policies", "cost_ttft", "--no-plots",
            "--num-requests", "30", "--out", str(tmp_path / "run")]
    assert run_experiment(parse(argv)) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("multi_turn (simulated)"))
    replayed = int(header.split(": ")[1].split(" requests replayed")[0].replace(",", ""))
    assert ", 30 measured (the rest warm-up)" in header
    # The count is of the stream that ran at 5 qps, not of the stream at the 1-qps reference rate.
    with open(tmp_path / "run" / "requests.csv") as rows:
        assert replayed == sum(1 for _ in csv.DictReader(rows)) > 30


def test_a_session_workload_at_two_rates_has_its_replayed_requests_counted_per_rate(tmp_path, capsys) -> None:
    from kvserve.experiments.experiment import run_experiment
    from tests.experiments.test_experiment import parse

    argv = ["--workload", "multi_turn", "--replicas", "2", "--qps", "4,8", "--policies", "cost_ttft", "--no-plots",
            "--num-requests", "30", "--out", str(tmp_path / "run")]
    assert run_experiment(parse(argv)) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("multi_turn (simulated)"))
    with open(tmp_path / "run" / "requests.csv") as rows:
        by_rate = collections.Counter(float(row["qps"]) for row in csv.DictReader(rows))
    assert by_rate[8.0] > by_rate[4.0]  # the more sessions under way, the longer the warm-up
    assert (f"{by_rate[4.0]} requests replayed at 4 qps, {by_rate[8.0]} at 8 qps; 30 measured (the rest warm-up)"
            in header)
    assert f"\n\n{header}\n\n" in (tmp_path / "run" / "summary.md").read_text()  # after the setup


def test_replayed_counts_names_only_the_requests_when_all_are_measured() -> None:
    assert replayed_counts({4.0: [True] * 3, 8.0: [True] * 3}) == "3 requests"


def test_replayed_counts_gives_one_count_when_every_rate_replayed_as_many() -> None:
    flags = [False] * 1500 + [True] * 2000
    assert replayed_counts({4.0: flags, 8.0: flags}) == "3,500 requests replayed, 2,000 measured (the rest warm-up)"


def test_replayed_counts_counts_each_rate_when_the_streams_differ_in_length() -> None:
    counts = replayed_counts({4.0: [False] + [True] * 2, 8.0: [False] * 3 + [True] * 2})
    assert counts == "3 requests replayed at 4 qps, 5 at 8 qps; 2 measured (the rest warm-up)"


def test_replayed_counts_counts_each_rate_in_full_when_the_measured_differ() -> None:
    counts = replayed_counts({4.0: [False] + [True] * 2, 8.0: [False] + [True]})
    assert counts == (
        "3 requests replayed at 4 qps, 2 measured; 2 requests replayed at 8 qps, 1 measured (the rest warm-up)"
    )
