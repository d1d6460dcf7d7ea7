"""``deploy/kvserve-frontend``: the background service that runs ``kvserve serve`` on a
``ray up`` head node, driven here with a stand-in ``kvserve`` on PATH."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.deploy.stand_ins import recorded_lines

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "kvserve-frontend"

# Rejects --bad like a usage error (status 2); otherwise fails its first run with status 1
# (as when no GPUs are free yet), then serves until SIGTERM.  Records runs and shutdowns.
FAKE_KVSERVE = """#!/usr/bin/env bash
runs="$KVSERVE_FRONTEND_DIR/runs"
echo "$*" >> "$runs"
case " $* " in *" --bad "*) exit 2 ;; esac
[ "$(wc -l < "$runs")" -gt 1 ] || exit 1
trap 'echo stopped >> "$runs"; exit 0' TERM
while true; do sleep 0.05; done
"""

Frontend = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def frontend(tmp_path: Path) -> Iterator[Frontend]:
    """Runs ``kvserve-frontend ARGS`` with its state in tmp_path; stops the service after the test."""
    fake = tmp_path / "bin" / "kvserve"
    fake.parent.mkdir()
    fake.write_text(FAKE_KVSERVE)
    fake.chmod(0o755)
    env = os.environ | {
        "PATH": f"{fake.parent}:{os.environ['PATH']}",
        "KVSERVE_FRONTEND_DIR": str(tmp_path),
        "KVSERVE_FRONTEND_RETRY_S": "0.1",
        "KVSERVE_FRONTEND_CHECK_S": "1",
    }

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)

    yield run
    run("stop")


def runs(tmp_path: Path, count: int) -> list[str]:
    """The stand-in's record, once it has at least ``count`` lines."""
    return recorded_lines(tmp_path / "runs", count, timeout_s=10)


def test_a_failed_serve_runs_again_and_stop_sends_sigterm(frontend: Frontend, tmp_path: Path) -> None:
    started = frontend("start", "--address", "auto", "--replicas", "2")
    assert started.returncode == 0, started.stderr
    assert runs(tmp_path, 2) == ["serve --address auto --replicas 2"] * 2
    assert frontend("status").returncode == 0
    assert frontend("stop").returncode == 0
    assert runs(tmp_path, 3)[2] == "stopped"
    assert frontend("status").returncode == 3
    assert "kvserve serve failed" in (tmp_path / "logs" / "serve.log").read_text()


def test_start_replaces_the_running_service(frontend: Frontend, tmp_path: Path) -> None:
    assert frontend("start", "--replicas", "1").returncode == 0
    runs(tmp_path, 2)
    assert frontend("start", "--replicas", "4").returncode == 0
    assert runs(tmp_path, 4)[2:] == ["stopped", "serve --replicas 4"]


def test_a_usage_error_ends_the_service_and_start_says_so(frontend: Frontend, tmp_path: Path) -> None:
    # It said "started", and the service was gone a second later.
    started = frontend("start", "--bad")
    assert started.returncode == 1
    assert "kvserve serve ended at once" in started.stderr
    assert frontend("status").returncode == 3
    time.sleep(0.3)  # three retry pauses
    assert runs(tmp_path, 1) == ["serve --bad"]


def test_a_serve_killed_by_a_signal_runs_again(frontend: Frontend, tmp_path: Path) -> None:
    assert frontend("start", "--replicas", "1").returncode == 0
    runs(tmp_path, 2)  # serving after its first failure
    serving = subprocess.run(["pgrep", "-f", f"{tmp_path}/bin/kvserve serve"], capture_output=True, text=True)
    pid = int(serving.stdout.split()[-1])
    os.kill(pid, 9)  # as the OOM killer does
    assert runs(tmp_path, 3)[2] == "serve --replicas 1"
    assert "kvserve serve failed (exit status 137)" in (tmp_path / "logs" / "serve.log").read_text()
