"""Suite-wide test options: ``gpu`` tests skip on machines without CUDA; Ctrl-C is Ctrl-C;
every Ray the tests start stays on 127.0.0.1 and authenticates with a token."""

from __future__ import annotations

import os
import secrets
import signal

import pytest

from kvserve.cluster.ray_loopback import keep_ray_on_loopback

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
