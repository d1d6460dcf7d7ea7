"""``kvserve serve`` (and ``experiment``) in a child process as a user runs it, and what it leaves in its session."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import pytest

from kvserve.kernels.extension_build import CACHE_DIR_ENV, build_root

STARTUP_TIMEOUT_S = 180.0
COMMAND_TIMEOUT_S = 60.0


def kvserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvserve.cli", *args]


class ServeProcess:
    """``kvserve serve`` in a child process, its output read line by line."""

    def __init__(
        self, args: list[str], env: dict[str, str], *, new_session: bool = False, command: str = "serve"
    ) -> None:
        self.proc = subprocess.Popen(
            kvserve(command, *args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=new_session,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
            if match := re.search(pattern, line):
                return match
        pytest.fail(f"kvserve serve never printed {pattern!r}; it printed:\n{''.join(self.lines)}")

    def wait_exit(self, timeout_s: float) -> int:
        """Its exit status; a test failure showing what it printed if it is still running after ``timeout_s``."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"kvserve {self.proc.args[3]} still runs after {timeout_s:g} s; it printed:\n"
                        f"{self.printed_so_far()}")

    def printed_so_far(self) -> str:
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
        return "".join(self.lines)

    def output(self) -> str:
        while (line := self._queue.get(timeout=COMMAND_TIMEOUT_S)) is not None:
            self.lines.append(line)
        return "".join(self.lines)


def serve_env(cache_dir: Path) -> dict[str, str]:
    """The environment of a `kvserve` subprocess whose cache is ``cache_dir``.

    NOTE: the kernels' builds stay shared with the rest of the suite (the build
    root this process uses): in a fresh cache each served replica's worker
    compiled the C++ kernel again, and the module's server took 33 s instead of
    9.5 s to get its replica ready on a 2-core machine.
    """
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env[CACHE_DIR_ENV] = str(cache_dir)
    shared = build_root().parent
    shared.mkdir(parents=True, exist_ok=True)
    with mock.patch.dict(os.environ, {CACHE_DIR_ENV: str(cache_dir)}):
        link = build_root().parent  # where the subprocess's builds go
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(shared, target_is_directory=True)
    return env


def session_processes(session_id: int) -> list[str]:
    """The processes left in session ``session_id``: Ray's daemons stay in the session of whoever started them."""
    # NOTE: -ww, or ps cuts each line at 80 columns when not writing to a terminal,
    # and a long install path hid "raylet" in CI.
    listing = subprocess.run(["ps", "-ww", "-e", "-o", "sid=,pid=,args="], capture_output=True, text=True, check=True)
    return [line.strip() for line in listing.stdout.splitlines() if int(line.split()[0]) == session_id]



def wait_for_session_process(process: ServeProcess, name: str, timeout_s: float) -> None:
    """Until a process whose command line holds ``name`` runs in ``process``'s session."""
    deadline = time.monotonic() + timeout_s
    while not any(name in line for line in session_processes(process.proc.pid)):
        if process.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no {name} process in the session of kvserve serve, which printed:\n{process.printed_so_far()}")
        time.sleep(0.05)


def assert_nothing_left(session_id: int) -> None:
    deadline = time.monotonic() + 20.0
    while (left := session_processes(session_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, "left running:\n" + "\n".join(left)


def kill_what_is_left(session_id: int) -> None:
    for line in session_processes(session_id):
        with contextlib.suppress(ProcessLookupError):  # it may have exited since the listing
            os.kill(int(line.split()[1]), signal.SIGKILL)


def simulated_serve(tmp_path: Path, model_dir: Path) -> ServeProcess:
    return ServeProcess(
        ["--model", str(model_dir), "--port", "0", "--http-port", "0", "--simulated", "--num-blocks", "64"],
        serve_env(tmp_path),
        new_session=True,
    )
