"""``kvserve serve`` in a child process and a session of its own, as a supervisor runs it.

Its local Ray instance's daemons and actors stay in that session, so that what
the server leaves behind when it exits can be listed (``session_processes``)
and, at the end, stopped, without touching any other Ray instance on the machine.
A ``RayDriver`` (a process of its own) connects to that Ray instance
(``ray_address``) to kill its actors by name, or find their PIDs.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
# The longest a RayDriver may take to answer (connecting to Ray included).
DRIVER_TIMEOUT_S = 60.0


def serve_args(model_dir: str | Path, *, num_replicas: int, tp_size: int, num_blocks: int,
               max_concurrent_requests: int, routing: str | None = "round_robin") -> list[str]:
    """``kvserve serve``'s flags for a CPU cluster on a free loopback port, without HTTP.

    ``routing``: the policy's name, or None for serve's default.
    """
    return [
        "--model", str(model_dir), "--device", "cpu", "--replicas", str(num_replicas), "--tp", str(tp_size),
        "--num-blocks", str(num_blocks), *(["--routing", routing] if routing is not None else []),
        "--host", "127.0.0.1", "--port", "0", "--no-http", "--max-concurrent-requests", str(max_concurrent_requests),
    ]


class ServeProcess:
    """``kvserve serve ARGS`` started at construction; ``close()`` stops it and whatever its session holds."""

    def __init__(self, args: list[str]) -> None:
        env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}  # its own Ray instance
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.cli", "serve", *args],
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

    def ray_address(self) -> str:
        """The GCS address (``host:port``) of its local Ray instance, from its Ray daemons' command lines."""
        for _, args in self.session_processes():
            if match := re.search(r"--gcs-address=(\S+)", args):
                return match.group(1)
        raise RuntimeError("no Ray daemon with a --gcs-address in kvserve serve's session")

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


class RayDriver:
    """A Ray driver in a child process, connected to the Ray instance at ``address`` (namespace
    ``kvserve``): it kills actors by name and finds their processes' PIDs.

    NOTE: a process of its own because serve's Ray instance ends with serve (or when its scheduler is
    killed): a driver whose GCS is gone retries, then ends its process, and a shutdown waits on it;
    this one is just ended.
    """

    def __init__(self, address: str) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_driver_loop, args=(address, child_conn), daemon=True)
        self._process.start()
        child_conn.close()

    async def ping(self) -> None:
        """Returns once the driver is connected (``RuntimeError`` or ``TimeoutError`` if it cannot)."""
        await self._ask("ping", "")

    async def kill(self, name: str) -> None:
        """``ray.kill`` the live actor ``name`` (no restart); returns once Ray has taken the kill."""
        await self._ask("kill", name)

    async def pid(self, name: str) -> int:
        """The PID of the process of the live actor ``name``."""
        return await self._ask("pid", name)

    async def _ask(self, op: str, name: str) -> Any:
        def ask() -> Any:
            self._conn.send((op, name))
            try:
                if not self._conn.poll(DRIVER_TIMEOUT_S):
                    raise TimeoutError(f"the Ray driver did not answer {op} {name} within {DRIVER_TIMEOUT_S:g} s")
                ok, value = self._conn.recv()
            except EOFError:
                raise RuntimeError(f"the Ray driver exited (code {self._process.exitcode})") from None
            if not ok:
                raise RuntimeError(f"the Ray driver: {op} {name}: {value}")
            return value

        return await asyncio.get_running_loop().run_in_executor(None, ask)

    def close(self) -> None:
        if self._process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(("exit", ""))
            self._process.join(5.0)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._conn.close()


def _driver_loop(address: str, conn: Any) -> None:
    """The driver's process: answers ``(op, actor name)`` requests until ``exit``."""
    # NOTE: a new local Ray instance (serve's) turns token authentication on unless RAY_AUTH_MODE says
    # otherwise, but Ray 2.60 joining a cluster sends its token only when RAY_AUTH_MODE=token; it is
    # read when ray is first imported (below).
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray
    # NOTE: Ray's actor table, read from the GCS: ray.util.state asks the dashboard, which serve does not start.
    from ray._private import state

    from kvserve.cluster.launcher import join_ray
    from kvserve.cluster.worker_actor import RAY_NAMESPACE

    try:
        join_ray(address)
    except Exception as exc:  # noqa: BLE001 - told to the parent, which waits for an answer
        conn.send((False, f"cannot connect to Ray at {address}: {type(exc).__name__}: {exc}"))
        conn.close()
        os._exit(1)
    while (request := conn.recv())[0] != "exit":
        op, name = request
        try:
            if op == "kill":
                answer = ray.kill(ray.get_actor(name, namespace=RAY_NAMESPACE), no_restart=True)
            elif op == "pid":
                alive = [a["Pid"] for a in state.actors().values() if a["Name"] == name and a["State"] == "ALIVE"]
                if len(alive) != 1:
                    raise LookupError(f"{len(alive)} live actors named {name!r}")
                answer = alive[0]
            else:
                answer = None
            conn.send((True, answer))
        except Exception as exc:  # noqa: BLE001 - told to the parent
            conn.send((False, f"{type(exc).__name__}: {exc}"))
    conn.close()
    os._exit(0)  # NOTE: not ray.shutdown(): its GCS may be gone, and a shutdown would wait on it
