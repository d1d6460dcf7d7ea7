"""bench.worker_timeline: steps timed per launch, summed per run window, carried through a file."""

from __future__ import annotations

import time
from types import SimpleNamespace

from kvserve.bench.worker_timeline import StepRecord, TimedRunner, read_records, summarize


class _Runner:
    launches_ahead = False

    def __init__(self) -> None:
        self.shut_down = False

    def launch(self, plan):  # noqa: ANN001, ANN201
        time.sleep(0.002)
        return SimpleNamespace(result=lambda: f"result of {plan.step_id}")

    def shutdown(self) -> None:
        self.shut_down = True


def test_a_window_sums_its_own_steps_and_the_idle_time_between_them() -> None:
    records = [StepRecord(10.0, 0.001, None, 0.004, None), StepRecord(11.0, 0.002, 0.2, 0.005, 0.003),
               StepRecord(12.0, 0.003, 0.004, 0.006, 0.002), StepRecord(20.0, 0.004, 5.0, 0.007, 0.5)]
    summary = summarize(records, 11.0, 13.0)
    # the window's first step's idle time is the gap after a step of another window: not counted
    assert (summary.num_steps, summary.host_s, summary.gap_s, summary.device_s, summary.idle_s) == (
        2, 0.005, 0.004, 0.011, 0.002)
    assert summary.row("run") == ["run", "2", "2.50", "2.00", "5.50", "1.00", "0.15"]


def test_without_device_times_the_row_says_so() -> None:
    summary = summarize([StepRecord(1.0, 0.002, None, None, None), StepRecord(2.0, 0.004, 0.001, None, None)],
                        0.0, 5.0)
    assert summary.row("cpu") == ["cpu", "2", "3.00", "0.50", "-", "-", "-"]
    assert summarize([], 0.0, 5.0).row("none") == ["none", "0", "-", "-", "-", "-", "-"]


def test_a_timed_runner_records_steps_with_rows_and_writes_them_at_shutdown(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "timeline.json"
    inner = _Runner()
    timed = TimedRunner(inner, str(path))
    assert timed.execute(SimpleNamespace(step_id=1, req_ids=["a"])) == "result of 1"
    timed.launch(SimpleNamespace(step_id=2, req_ids=[]))  # no rows: not a step of the timeline
    timed.launch(SimpleNamespace(step_id=3, req_ids=["a", "b"]))
    assert timed.launches_ahead is False and timed.runner is inner  # the rest is the wrapped runner's
    timed.shutdown()
    assert inner.shut_down
    records = read_records(path)
    assert records == timed.records() and len(records) == 2
    assert all(r.host_s >= 0.002 and r.device_s is None for r in records)
    assert records[0].launched_at <= records[1].launched_at
    assert records[0].gap_before_s is None and records[1].gap_before_s >= 0.002  # step 2's launch came between
