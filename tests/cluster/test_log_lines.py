"""Log lines fit a file or journal: no colour codes around the actors' (``(SchedulerActor pid=...)``), one line
per record."""

from __future__ import annotations

import io
import logging
import os
import sys

import pytest

from kvserve.cluster.launcher import plain_actor_logs_off_a_terminal

COLOURS = "RAY_COLOR_PREFIX"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_output_to_a_file_or_pipe_gets_no_colour_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(COLOURS, raising=False)
    monkeypatch.setattr(sys, "stdout", Terminal())
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file

    plain_actor_logs_off_a_terminal()

    assert os.environ[COLOURS] == "0"


def test_a_terminal_keeps_rays_colours(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(COLOURS, raising=False)
    monkeypatch.setattr(sys, "stdout", Terminal())
    monkeypatch.setattr(sys, "stderr", Terminal())

    plain_actor_logs_off_a_terminal()

    assert COLOURS not in os.environ


def test_the_environments_choice_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COLOURS, "1")

    plain_actor_logs_off_a_terminal()

    assert os.environ[COLOURS] == "1"


def test_a_log_record_is_one_line_but_a_traceback_keeps_its_own() -> None:
    # Ray's ActorDiedError names the actor on lines of their own, which read as records of their own.
    from kvserve.cluster.log_format import OneLineFormatter

    died = "replica 0 failed: The actor died.\n\tclass_name: WorkerActor\n\tpid: 14520"
    record = logging.LogRecord("kvserve.x", logging.ERROR, __file__, 1, died, None, None)
    assert OneLineFormatter().format(record).endswith(
        "ERROR kvserve.x: replica 0 failed: The actor died. class_name: WorkerActor pid: 14520"
    )
    try:
        raise ValueError("a bug")
    except ValueError:
        record = logging.LogRecord("kvserve.x", logging.ERROR, __file__, 1, "step failed", None, sys.exc_info())
    lines = OneLineFormatter().format(record).splitlines()
    assert lines[0].endswith("ERROR kvserve.x: step failed") and lines[1] == "Traceback (most recent call last):"
