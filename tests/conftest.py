"""Suite-wide test options: ``gpu`` tests skip on machines without CUDA; Ctrl-C is Ctrl-C."""

from __future__ import annotations

import signal

import pytest


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
