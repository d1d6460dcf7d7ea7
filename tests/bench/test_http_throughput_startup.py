"""``bench.http_throughput``'s server start: a bad ``--model`` is a usage error, a server that hangs silently
times out, and a SIGTERM while it starts stops it.  A fake ``kvserve serve`` (a process that prints nothing
and sleeps) stands in for the real one."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from kvserve.bench import http_throughput, serve_process
from kvserve.bench.serve_process import ServeProcess
from kvserve.cluster.interrupts import sigterm_as_interrupt


@pytest.fixture
def silent_serves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[ServeProcess]:
    """Every ``ServeProcess`` started runs a silent sleeper instead of Python; the list holds them."""
    sleeper = tmp_path / "python"
    sleeper.write_text("#!/bin/sh\nexec sleep 30\n")
    sleeper.chmod(0o755)
    monkeypatch.setattr(serve_process.sys, "executable", str(sleeper))
    started: list[ServeProcess] = []

    class Recorded(ServeProcess):
        def __init__(self, args: list[str]) -> None:
            super().__init__(args)
            started.append(self)

    monkeypatch.setattr(http_throughput, "ServeProcess", Recorded)
    return started


def test_a_model_that_is_not_a_directory_is_a_usage_error_naming_the_flag(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        http_throughput.main(["--model", "/nonexistent/model"])
    assert info.value.code == 2
    assert "argument --model: '/nonexistent/model' is not a model directory" in capsys.readouterr().err


def test_a_server_that_says_nothing_times_out_and_is_stopped(silent_serves, tmp_path) -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not start"):
        with http_throughput.served(tmp_path, 4, startup_timeout_s=1.0):
            pass
    assert time.monotonic() - start < 10.0
    (serve,) = silent_serves
    assert serve.proc.poll() is not None


def test_a_sigterm_while_the_server_starts_stops_it(silent_serves, tmp_path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(KeyboardInterrupt):  # as Ctrl-C (kvserve.cluster.interrupts.sigterm_as_interrupt)
        with sigterm_as_interrupt(), http_throughput.served(tmp_path, 4, startup_timeout_s=30.0):
            pass
    (serve,) = silent_serves
    assert serve.proc.poll() is not None
    assert signal.getsignal(signal.SIGTERM) == before  # the previous handler is back
