"""Fault b: the scheduler actor of a ``kvserve serve`` is SIGKILLed while streams run.

The server cannot serve without it (it holds the routing and every replica's
step loop) and does not start it again: it must end every stream with a clear
status, stop saying SERVING, and exit non-zero at once, leaving no Ray process
behind, so that a supervisor starts it again.  Health is polled throughout
(``HEALTH_POLL_S``): the short time after the kill during which it still says
SERVING is how long the server takes to notice.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.bench.fault_streams import Scenario, StreamResult, divergences, one_stream, p99
from kvserve.bench.serve_process import ServeProcess

HEALTH_POLL_S = 0.02
EXIT_TIMEOUT_S = 60.0
UNREACHABLE = "UNREACHABLE"


@dataclass(frozen=True, slots=True)
class SchedulerKill:
    """What the server did after its scheduler actor was killed."""

    exit_code: int | None  # None: still running EXIT_TIMEOUT_S after the kill
    exit_s: float | None  # from the kill until the process exited
    last_serving_s: float | None  # the last health answer SERVING, after the kill (None: none after it)
    first_not_serving_s: float | None  # the first answer other than SERVING (or no answer) after the kill
    first_not_serving: str | None  # that answer: NOT_SERVING, or UNREACHABLE
    serving_again: bool  # SERVING once more after an answer that was not
    processes_left: list[str]  # its session's processes 20 s after it exited
    error_line: str | None  # what it said on stderr about it

    def notes(self, name: str) -> list[str]:
        exited = ("still running" if self.exit_code is None
                  else f"exited with code {self.exit_code} {self.exit_s:.2f} s after the kill")
        serving = ("no health answer said SERVING after the kill" if self.last_serving_s is None
                   else f"health said SERVING until {self.last_serving_s:.3f} s after the kill")
        not_serving = ("" if self.first_not_serving_s is None
                       else f", {self.first_not_serving} from {self.first_not_serving_s:.3f} s")
        again = "SERVING again later" if self.serving_again else "never SERVING again"
        return [
            f"{name}: serve {exited}; {serving}{not_serving}; {again}; "
            f"{len(self.processes_left)} process(es) of its session left",
            f"{name}: it said: {self.error_line or '(nothing about the scheduler)'}",
        ]


def _error_line(output: list[str]) -> str | None:
    """What serve said about the scheduler: its own error line (``kvserve serve: error: ...``) if any,
    else the first logged line that names the scheduler and an error (the front end's own log lines
    come first, and Ray's may share a line with them)."""
    about = [line for line in output if "scheduler" in line and "error" in line]
    return next((line for line in about if line.startswith("kvserve serve: error")), about[0] if about else None)


def scheduler_pid(serve: ServeProcess) -> int:
    """The process of the scheduler actor (``kvserve-scheduler``, class ``SchedulerActor``) in serve's session."""
    for pid, args in serve.session_processes():
        if "SchedulerActor" in args:
            return pid
    raise RuntimeError("no SchedulerActor process in kvserve serve's session")


async def watch_health(channel, timeline: list[tuple[float, str]], stop: asyncio.Event) -> None:
    """Append (monotonic time, overall health status or UNREACHABLE) every ``HEALTH_POLL_S`` until ``stop``."""
    stub = health_pb2_grpc.HealthStub(channel)
    while not stop.is_set():
        try:
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
        except Exception:  # noqa: BLE001 - any failure to answer is "not serving"
            status = UNREACHABLE
        timeline.append((time.monotonic(), status))
        await asyncio.sleep(HEALTH_POLL_S)


async def wait_for_exit(serve: ServeProcess, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while (code := serve.proc.poll()) is None and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return code


async def sigkill_scheduler(serve: ServeProcess) -> str:
    """SIGKILL serve's scheduler actor process; says what it killed."""
    pid = scheduler_pid(serve)
    os.kill(pid, signal.SIGKILL)
    return f"SIGKILLed the scheduler actor (pid {pid})"


async def scenario_scheduler_kill(serve: ServeProcess, channel, stub, prompts: list[list[int]], max_tokens: int,
                                  kill: Callable[[], Awaitable[str]] | None = None,
                                  name: str = "b. kill the scheduler") -> tuple[Scenario, SchedulerKill]:
    """Run ``prompts`` (the baseline), then again, killing the scheduler once a third have their first tokens.

    ``kill`` kills it and says how (default: ``sigkill_scheduler``); ``name`` is the row's.
    """
    baseline = await asyncio.gather(*(one_stream(stub, p, max_tokens) for p in prompts))
    if any(b.code != "OK" for b in baseline):
        raise RuntimeError(f"{name}: the baseline run failed: {Counter(b.code for b in baseline)}")
    timeline: list[tuple[float, str]] = []
    stop_watching = asyncio.Event()
    watcher = asyncio.create_task(watch_health(channel, timeline, stop_watching))
    started = [asyncio.Event() for _ in prompts]
    tasks = [asyncio.create_task(one_stream(stub, p, max_tokens, started=e)) for p, e in zip(prompts, started)]
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while sum(e.is_set() for e in started) < len(prompts) // 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    running = sum(not t.done() for t in tasks)
    killed_at = time.monotonic()  # NOTE: from the kill's start: a kill through Ray takes a round trip
    done = await (kill() if kill is not None else sigkill_scheduler(serve))
    print(f"  {done} while {running} streams ran", flush=True)
    exit_code = await wait_for_exit(serve, EXIT_TIMEOUT_S)
    exit_s = time.monotonic() - killed_at if exit_code is not None else None
    results: list[StreamResult] = await asyncio.gather(*tasks)
    await asyncio.sleep(0.2)  # a few answers from the exited server: none
    stop_watching.set()
    await watcher
    after = [(t - killed_at, status) for t, status in timeline if t >= killed_at]
    serving = [t for t, status in after if status == "SERVING"]
    not_serving = [(t, status) for t, status in after if status != "SERVING"]
    kill = SchedulerKill(
        exit_code=exit_code,
        exit_s=exit_s,
        last_serving_s=max(serving) if serving else None,
        first_not_serving_s=not_serving[0][0] if not_serving else None,
        first_not_serving=not_serving[0][1] if not_serving else None,
        serving_again=bool(serving and not_serving and max(serving) > not_serving[0][0]),
        processes_left=[args for _, args in serve.processes_left()] if exit_code is not None else ["kvserve serve"],
        error_line=_error_line(serve.output),
    )
    scenario = Scenario(
        name, len(prompts), sum(r.code == "OK" and r.token_ids == b.token_ids for r, b in zip(results, baseline)),
        sum(len(set(r.replicas)) > 1 for r in results), Counter(r.code for r in results), None, None,
        p99([r.seconds for r in results if r.code == "OK"]), p99([b.seconds for b in baseline]),
        divergences(list(zip(results, baseline))), kill.notes(name),
    )
    ended_clearly = sum(scenario.codes[code] for code in ("OK", "UNAVAILABLE"))
    scenario.requirements = [
        ("serve exits non-zero", exit_code not in (None, 0)),
        ("health not SERVING again", kill.first_not_serving_s is not None and not kill.serving_again),
        ("no process of its session left", not kill.processes_left),
        ("streams end OK with their tokens or UNAVAILABLE",
         ended_clearly == scenario.sent and scenario.correct == scenario.codes["OK"]),
    ]
    details = Counter(r.details for r in results if r.code != "OK")
    scenario.notes += [f"{name}: {n} stream(s) ended with: {text}" for text, n in details.most_common(3)]
    return scenario, kill
