"""``timing`` tests run alone on a suite of several processes: the lock every test holds while it runs.

Threads stand in for the suite's processes: ``flock`` locks belong to open files, and each
``running`` block opens its own, so two blocks in one process exclude each other as two
processes' would.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests import timing_lock

WAIT_S = 5.0


@pytest.fixture
def lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(timing_lock.LOCK_DIR_ENV, str(tmp_path))
    return tmp_path


class Holder(threading.Thread):
    """A test on another process: enters ``running(exclusive)``, records when, and leaves when told."""

    def __init__(self, name: str, exclusive: bool, log: list[str]) -> None:
        super().__init__(daemon=True)
        self.label, self.exclusive, self.log = name, exclusive, log
        self.entered = threading.Event()
        self.leave = threading.Event()

    def run(self) -> None:
        with timing_lock.running(self.exclusive):
            self.log.append(f"{self.label} in")
            self.entered.set()
            self.leave.wait(WAIT_S)
            self.log.append(f"{self.label} out")


def wait_until_held(path: Path) -> None:
    """Return once another open file holds ``path``'s lock."""
    deadline = time.monotonic() + WAIT_S
    with open(path, "a") as probe:
        while time.monotonic() < deadline:
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            fcntl.flock(probe, fcntl.LOCK_UN)
            time.sleep(0.01)
    pytest.fail(f"nothing took the lock of {path} in {WAIT_S} s")


def test_tests_that_are_not_timing_run_side_by_side(lock_dir: Path) -> None:
    log: list[str] = []
    first, second = Holder("a", False, log), Holder("b", False, log)
    first.start()
    assert first.entered.wait(WAIT_S)
    second.start()
    assert second.entered.wait(WAIT_S)  # while the first still runs
    for holder in (first, second):
        holder.leave.set()
        holder.join(WAIT_S)
    assert log[:2] == ["a in", "b in"]


def test_a_timing_test_waits_for_the_running_test_and_no_new_test_starts_before_it_ends(lock_dir: Path) -> None:
    log: list[str] = []
    running = Holder("running", False, log)
    timing = Holder("timing", True, log)
    later = Holder("later", False, log)
    running.start()
    assert running.entered.wait(WAIT_S)
    timing.start()
    wait_until_held(lock_dir / "turnstile")  # by the timing test, waiting for the exclusive lock
    later.start()
    time.sleep(0.2)
    assert log == ["running in"]
    running.leave.set()
    assert timing.entered.wait(WAIT_S)
    time.sleep(0.2)
    assert not later.entered.is_set()  # kept out while the timing test runs
    timing.leave.set()
    assert later.entered.wait(WAIT_S)
    later.leave.set()
    for holder in (running, timing, later):
        holder.join(WAIT_S)
    assert log == ["running in", "running out", "timing in", "timing out", "later in", "later out"]


def test_a_process_of_a_run_that_set_no_lock_folder_locks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(timing_lock.LOCK_DIR_ENV, raising=False)
    log: list[str] = []
    first, second = Holder("a", True, log), Holder("b", True, log)
    first.start()
    assert first.entered.wait(WAIT_S)
    second.start()
    assert second.entered.wait(WAIT_S)
    for holder in (first, second):
        holder.leave.set()
        holder.join(WAIT_S)


def test_the_suite_names_a_lock_folder_that_exists_while_it_runs() -> None:
    folder = os.environ.get(timing_lock.LOCK_DIR_ENV)
    assert folder and Path(folder).is_dir()


def test_under_two_workers_a_timing_test_runs_while_no_other_test_does(tmp_path: Path) -> None:
    # The suite's hooks (tests/conftest.py) in a pytest run of their own on two workers: a file of
    # plain tests, and one whose timing test would otherwise start beside them.
    log = tmp_path / "log"
    record = (
        "import time\nimport pytest\n\n"
        "def record(name, seconds):\n"
        f"    with open({str(log)!r}, 'a') as f: f.write(f'{{name}} {{time.monotonic()}}\\n')\n"
        "    time.sleep(seconds)\n"
        f"    with open({str(log)!r}, 'a') as f: f.write(f'{{name}} {{time.monotonic()}}\\n')\n\n"
    )
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_configure, pytest_runtest_protocol, pytest_unconfigure  # noqa: F401\n"
    )
    (tmp_path / "test_plain.py").write_text(
        record + "@pytest.mark.parametrize('i', range(4))\ndef test_plain(i):\n    record(f'plain{i}', 0.5)\n"
    )
    (tmp_path / "test_timed.py").write_text(record + "@pytest.mark.timing\ndef test_timed():\n    record('timed', 0.5)\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile",
         "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    spans: dict[str, list[float]] = {}
    for line in log.read_text().splitlines():
        name, when = line.split()
        spans.setdefault(name, []).append(float(when))
    assert sorted(spans) == ["plain0", "plain1", "plain2", "plain3", "timed"]
    start, end = spans.pop("timed")
    assert all(other_end <= start or other_start >= end for other_start, other_end in spans.values()), spans
