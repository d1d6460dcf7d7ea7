"""``kvserve serve`` in a child process and a session of its own, as a supervisor runs it.

Its local Ray instance's daemons and actors stay in that session, so that what
the server leaves behind when it exits can be listed (``session_processes``)
and, at the end, stopped, without touching any other Ray instance on the machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0


def serve_args(model_dir: str | Path, *, num_replicas: int, tp_size: int, num_blocks: int,
               max_concurrent_requests: int) -> list[str]:
    """``kvserve serve``'s flags for a CPU cluster on a free loopback port, without HTTP."""
    return [
        "--model", str(model_dir), "--device", "cpu", "--replicas", str(num_replicas), "--tp", str(tp_size),
        "--num-blocks", str(num_blocks), "--routing", "round_robin", "--host", "127.0.0.1", "--port", "0",
        "--no-http", "--max-concurrent-requests", str(max_concurrent_requests),
    ]


class ServeProcess:
    """``kvserve serve ARGS`` started at construction; ``close()`` stops it and whatever its session holds."""

    def __init__(self, args: list[str]) -> None:
        env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}  # its own Ray instance
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.cluster.cli", "serve", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=env,
            start_new_session=True,
        )
        self.session_id = self.proc.pid
        self._lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self._lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    @property
    def output(self) -> list[str]:
        """The lines it printed so far (stdout and stderr)."""
        with self._changed:
            return list(self._lines)

    def wait_for_port(self, timeout_s: float = STARTUP_TIMEOUT_S) -> int:
        """The gRPC port once it says it listens; ``RuntimeError`` with its output if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self._changed:
            while True:
                for line in self._lines[seen:]:
                    if match := re.search(r"listening on \S+:(\d+)", line):
                        return int(match.group(1))
                seen = len(self._lines)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    tail = "\n".join(self._lines[-30:])
                    raise RuntimeError(f"kvserve serve did not start (exit code {self.proc.poll()}):\n{tail}")
                self._changed.wait(min(remaining, 0.5))

    def session_processes(self) -> list[tuple[int, str]]:
        """(pid, command line) of every process in its session, itself included while it runs."""
        # NOTE: -ww, or ps cuts each line at 80 columns when not writing to a terminal.
        listing = subprocess.run(["ps", "-ww", "-e", "-o", "sid=,pid=,args="], capture_output=True, text=True,
                                 check=True)
        found = []
        for line in listing.stdout.splitlines():
            sid, pid, args = (line.split(None, 2) + [""])[:3]
            if int(sid) == self.session_id:
                found.append((int(pid), args))
        return found

    def processes_left(self, timeout_s: float = 20.0) -> list[tuple[int, str]]:
        """Its session's processes still there ``timeout_s`` after it exited (Ray's take a moment to stop)."""
        deadline = time.monotonic() + timeout_s
        while (left := self.session_processes()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    def close(self) -> None:
        """Stop it as Ctrl-C does, then SIGKILL what its session still holds (its own processes only)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid, _ in self.processes_left(timeout_s=10.0):
            with contextlib.suppress(ProcessLookupError):  # it may have exited since the listing
                os.kill(pid, signal.SIGKILL)
        self._reader.join(timeout=5.0)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
