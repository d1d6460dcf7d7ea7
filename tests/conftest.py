"""Suite-wide test options: ``gpu`` tests skip on machines without CUDA; Ctrl-C is Ctrl-C;
every Ray the tests start stays on 127.0.0.1 and authenticates with a token; ``timing``
tests run alone when the suite runs on several processes (``tests.timing_lock``)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import tempfile
from collections.abc import Iterator

import pytest

from kvserve.cluster.ray_loopback import keep_ray_on_loopback
from tests import timing_lock

# NOTE: set when the suite starts, before any test module is imported: Ray reads its
# authentication mode (and its loopback switch) once, when it is first imported, and a test
# module collected before the cluster tests' (tests/bench) imports it.  Every process of the
# session inherits them.  This session's token is new and lives only in its processes'
# environment.
keep_ray_on_loopback()
os.environ["RAY_AUTH_MODE"] = "token"
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))


def pytest_configure(config: pytest.Config) -> None:
    # A shell without job control starts a background command with SIGINT ignored, and its
    # children inherit that: the tests that stop experiments and servers with Ctrl-C (and
    # their subprocesses) need it delivered, as it is in a terminal.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not hasattr(config, "workerinput"):  # the first process: pytest-xdist's workers start after this
        os.environ[timing_lock.LOCK_DIR_ENV] = tempfile.mkdtemp(prefix="kvserve-test-locks-")


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = os.environ.pop(timing_lock.LOCK_DIR_ENV, None)
    if folder and not hasattr(config, "workerinput"):
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with timing_lock.running(exclusive=item.get_closest_marker(timing_lock.MARKER) is not None):
        return (yield)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
