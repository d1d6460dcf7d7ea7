"""``bench.faults`` on a real local cluster: a killed worker loses no stream and leaks no block."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_a_killed_worker_loses_no_stream_and_cancels_leave_no_block() -> None:
    # Its own process: the benchmark starts (and stops) a Ray instance of its own.
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.bench.faults", "--streams", "9", "--max-tokens", "8", "--scenarios", "ac"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in result.stdout.splitlines() if line.startswith("|") and ". " in line}
    sent, correct, moved, ended, blocks, recovery = rows["a. kill a worker rank"][:6]
    assert (sent, correct, ended, blocks) == ("9", "9", "OK 9", "0")
    assert int(moved) >= 1 and float(recovery) < 60
    sent, correct, _, ended, blocks = rows["c. cancels and deadlines"][:5]
    assert blocks == "0" and int(correct) == sum(int(part.split()[1]) for part in ended.split(", ") if part.startswith("OK"))
