"""``bench.http_throughput``: the same streams through HTTP, gRPC and in process, in one table."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve.worker.tiny_model import create_tiny_model


@pytest.mark.slow
def test_the_table_has_every_way_in_and_the_ratio_of_http_to_grpc(tmp_path) -> None:
    model_dir = create_tiny_model(tmp_path / "tiny-llama", "llama", seed=0)
    # Its own process: the benchmark starts (and stops) a `kvserve serve` with a Ray instance of its own.
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.bench.http_throughput", "--model", str(model_dir), "--streams", "4",
         "--max-tokens", "8", "--repeat", "1"],
        capture_output=True, text=True, timeout=300,
    )

    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("|") and "way in" not in line]
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]] for line in lines[1:]}
    assert set(rows) == {"gRPC", "HTTP", "in process"}
    assert all(row[:2] == ["4", "32"] and float(row[2]) > 0 for row in rows.values())
    assert rows["gRPC"][3] == "1"
    assert "HTTP / gRPC = " in result.stdout
