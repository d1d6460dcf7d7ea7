"""Tests marked ``timing`` run while no other test does, when the suite runs on several processes.

Their assertions bound a time or compare one with a model of it (a live cluster's TTFT
against the simulator's, a stream still running when a kill lands, a restart within a
second); another test on the other core stretches those times.  Every test holds a
lock on a file while it runs (its fixtures' set-up and tear-down included): shared for
the others, exclusive for ``timing`` tests.  A second file is a turnstile: each test
takes it before the lock and lets go once it holds the lock, so that a ``timing`` test
waiting for the exclusive lock keeps new tests from starting meanwhile (``flock`` itself
would let shared holders take turns past it forever).

The suite's first process (pytest-xdist's controller, or the only one) makes the folder
of the two files and names it in ``LOCK_DIR_ENV`` before the workers start, which
inherit it; without it (a test process of a run that set no folder) nothing is locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_DIR_ENV = "KVSERVE_TEST_LOCK_DIR"
MARKER = "timing"


@contextlib.contextmanager
def running(exclusive: bool) -> Iterator[None]:
    """Within the block this process runs a test: alone (``exclusive``) or beside other non-exclusive ones."""
    folder = os.environ.get(LOCK_DIR_ENV)
    if not folder:
        yield
        return
    with open(Path(folder) / "turnstile", "a") as turnstile, open(Path(folder) / "lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            # NOTE: unlocked explicitly, not by closing: a process forked during the test shares
            # the open file, and the lock would stay held until that process closed it too.
            fcntl.flock(lock, fcntl.LOCK_UN)
