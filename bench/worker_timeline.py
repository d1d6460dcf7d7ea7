"""Where a worker's steps went: the host's launch of each, the device's run of it, and the
device's idle time between steps.

``TimedRunner`` wraps a step runner (a ``Worker``, in process or behind the step server) and
records, per step that has rows, the host's seconds inside ``launch``, the seconds since the
launch before it returned (in process: the scheduler's work and the wait for a result; over
gRPC: the wait for the next plan) and, on CUDA, two events
on the step's stream: one before the launch and one after it (the sampled tokens' copy is
queued by then).  The device's time on step i is event(start i) -> event(end i); its idle time
before step i + 1 is event(end i) -> event(start i + 1): time the device had nothing queued,
because the host had not launched the next step yet.  Without CUDA only host times exist.

``summarize(records, since, until)`` sums the steps launched in a wall-clock window (a timed
run), so one record list serves several runs.  Over the step protocol the runner lives in the
worker's process: ``timed_worker`` builds it there (``bench.grpc_replica.worker_server``'s
``runner``), and ``shutdown`` writes its records to a JSON file for this process to read.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.scheduler.step_plan import StepPlan

TIMELINE_HEADERS = ["path", "steps", "host launch ms/step", "between launches ms/step", "device ms/step",
                    "device idle ms/step", "device idle share"]


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One launched step: when (``time.time()``), the host's seconds in ``launch`` and since the
    launch before it ended (``None`` for the first step), the device's seconds on it and idle
    before it (``None`` without CUDA, or for the first step)."""

    launched_at: float
    host_s: float
    gap_before_s: float | None
    device_s: float | None
    idle_before_s: float | None


@dataclass(frozen=True, slots=True)
class TimelineSummary:
    num_steps: int
    host_s: float
    gap_s: float | None
    device_s: float | None
    idle_s: float | None

    def row(self, path: str) -> list[str]:
        def per_step(seconds: float | None) -> str:
            return f"{seconds / self.num_steps * 1e3:.2f}" if seconds is not None and self.num_steps else "-"

        busy = (self.device_s or 0.0) + (self.idle_s or 0.0)
        share = f"{self.idle_s / busy:.2f}" if self.idle_s is not None and busy > 0 else "-"
        return [path, str(self.num_steps), per_step(self.host_s), per_step(self.gap_s), per_step(self.device_s),
                per_step(self.idle_s), share]


class TimedRunner:
    """A step runner whose launches are timed (see the module docstring); every other attribute
    is the wrapped runner's.  ``records()`` waits for the device and gives every step so far."""

    def __init__(self, runner: Any, dump_path: str | None = None) -> None:
        self._runner = runner
        self._dump_path = dump_path
        # Device times where the runner's launch returns before the device ran the step (CUDA).
        self._on_cuda = torch.cuda.is_available() and bool(getattr(runner, "launches_ahead", False))
        # (at, perf_counter at the start, host s, start event, end event)
        self._launched: list[tuple[float, float, float, Any, Any]] = []

    @property
    def runner(self) -> Any:
        """The wrapped runner."""
        return self._runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def launch(self, plan: StepPlan) -> Any:
        start = end = None
        if self._on_cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        launched_at, began = time.time(), time.perf_counter()
        launched = self._runner.launch(plan)
        host_s = time.perf_counter() - began
        if self._on_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        if plan.req_ids:
            self._launched.append((launched_at, began, host_s, start, end))
        return launched

    def execute(self, plan: StepPlan) -> Any:
        return self.launch(plan).result()

    def records(self) -> list[StepRecord]:
        if any(start is not None for *_, start, _ in self._launched):
            torch.cuda.synchronize()
        records = []
        previous_end = previous_done = None
        for at, began, host_s, start, end in self._launched:
            gap_s = began - previous_done if previous_done is not None else None
            device_s = start.elapsed_time(end) / 1e3 if start is not None else None
            idle_s = previous_end.elapsed_time(start) / 1e3 if previous_end is not None and start is not None else None
            records.append(StepRecord(at, host_s, gap_s, device_s, idle_s))
            previous_end, previous_done = end, began + host_s
        return records

    def shutdown(self) -> None:
        if self._dump_path is not None:
            Path(self._dump_path).write_text(json.dumps([asdict(r) for r in self.records()]))
        self._runner.shutdown()


def timed_worker(dump_path: str, config: Any) -> TimedRunner:
    """A ``Worker`` of ``config`` behind a ``TimedRunner`` that writes its records to ``dump_path``
    at shutdown (``functools.partial(timed_worker, path)`` is ``worker_server``'s ``runner``)."""
    from kvserve.worker.worker import Worker

    return TimedRunner(Worker(config), dump_path)


def read_records(path: str | Path) -> list[StepRecord]:
    return [StepRecord(**fields) for fields in json.loads(Path(path).read_text())]


def summarize(records: list[StepRecord], since: float, until: float) -> TimelineSummary:
    """The steps launched in ``[since, until)`` (``time.time()``); a step's idle time counts
    only when the step before it is in the window too, and so does the host's time between launches."""
    chosen = [r for r in records if since <= r.launched_at < until]
    gaps = [r.gap_before_s for r in chosen[1:] if r.gap_before_s is not None]
    device = [r.device_s for r in chosen if r.device_s is not None]
    idle = [r.idle_before_s for r in chosen[1:] if r.idle_before_s is not None]
    return TimelineSummary(
        num_steps=len(chosen),
        host_s=sum(r.host_s for r in chosen),
        gap_s=sum(gaps) if gaps else None,
        device_s=sum(device) if device else None,
        idle_s=sum(idle) if idle else None,
    )
