"""Holding Ctrl-C back while a start-up that cannot be cut short safely runs."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def sigint_deferred(on_interrupt: Callable[[], None] | None = None) -> Iterator[Callable[[], bool]]:
    """Within the block a first SIGINT is recorded instead of raised; yields whether one came.

    ``on_interrupt`` is called when it comes (to tell the user to wait).  A
    second SIGINT raises ``KeyboardInterrupt`` at once, as a way out.  Outside
    the main thread, where Python delivers no signals, the block runs as is.
    """
    received = False

    def interrupted() -> bool:
        return received

    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal received
        if received:
            raise KeyboardInterrupt
        received = True
        if on_interrupt is not None:
            on_interrupt()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield interrupted
    finally:
        # Unless the block installed a handler of its own, which is then its to keep.
        if signal.getsignal(signal.SIGINT) is handler:
            signal.signal(signal.SIGINT, previous)
