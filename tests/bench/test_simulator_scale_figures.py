"""``bench.simulator_scale``'s figures: the warm-up's requests count where its time does, progress stays a
few lines, and the 5-minute target is judged only at its own scale."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from kvserve.bench import simulator_scale
from kvserve.bench.simulator_scale import TARGET_SCALE, RunTimes, target_verdict


def times(num_measured: int, num_warmup: int, total_s: float) -> RunTimes:
    return RunTimes(num_measured=num_measured, num_warmup=num_warmup, processes=1, workload_s=0.0, fleet_s=0.0,
                    simulate_s=total_s, num_steps=10, num_tokens=100, virtual_s=1.0)


def test_ms_per_request_divides_the_total_by_every_simulated_request_warm_up_included() -> None:
    run = times(num_measured=20, num_warmup=256, total_s=2.76)
    assert run.total_s == pytest.approx(2.76)
    assert run.ms_per_request == pytest.approx(10.0)  # 2.76 s over 276 simulated requests
    headers = simulator_scale.HEADERS
    row = dict(zip(headers, run.row()))
    assert (row["requests"], row["warm-up"], row["ms/request"]) == (20, 256, "10.00")


def test_the_target_is_judged_at_its_scale_only() -> None:
    at_scale = argparse.Namespace(**TARGET_SCALE)
    assert target_verdict(at_scale, 299.0) == "<= 300: yes"
    assert target_verdict(at_scale, 301.0) == "<= 300: NO"
    smaller = argparse.Namespace(**{**TARGET_SCALE, "replicas": 64, "requests": 20})
    assert "not judged at this scale" in target_verdict(smaller, 0.1)
    other_workload = argparse.Namespace(**{**TARGET_SCALE, "output_len": 1024})
    assert "not judged at this scale" in target_verdict(other_workload, 0.1)


def test_a_small_run_prints_about_ten_progress_lines_and_does_not_judge_the_target(capsys, monkeypatch) -> None:
    monkeypatch.setattr(simulator_scale, "object_read_times", lambda: SimpleNamespace(random_ns=90, sequential_ns=5))
    assert simulator_scale.main(["--replicas", "2", "--requests", "20", "--no-baseline", "--processes", "1"]) == 0
    out, err = capsys.readouterr()
    progress = [line for line in err.splitlines() if "% of all simulated" in line]
    assert 5 <= len(progress) <= simulator_scale.PROGRESS_LINES + 2
    assert "not judged at this scale" in out and ": yes" not in out


def test_the_processes_printed_are_those_that_ran_no_more_than_the_replicas(capsys, monkeypatch) -> None:
    monkeypatch.setattr(simulator_scale, "object_read_times", lambda: SimpleNamespace(random_ns=90, sequential_ns=5))
    # It printed "processes 4" and "speed-up of 4 processes" where one process ran one replica.
    assert simulator_scale.main(["--replicas", "1", "--requests", "20", "--processes", "4"]) == 0

    out = capsys.readouterr().out
    runs = [line for line in out.splitlines()[3:] if line.startswith("|")][:2]  # the baseline's, the full one's
    assert [dict(zip(simulator_scale.HEADERS, row.split("|")[1:]))["processes"].strip() for row in runs] == ["1", "1"]
    assert "speed-up of" not in out

