"""Ctrl-C and SIGTERM as one: stop requests that a start-up which cannot be cut short safely holds back.

``serve`` and ``experiment`` treat SIGTERM (what systemd, Kubernetes and
``kill`` send) as Ctrl-C: ``stop_on_sigterm`` (for the process's life) and
``sigterm_as_interrupt`` (for a block) make it raise ``KeyboardInterrupt``; under an
event loop, ``sigterm_cancels_task`` has the loop cancel the task instead (a raise
among gRPC's and Ray's callbacks can crash the process).  Ray's
``ray.init`` installs a handler of its own for SIGTERM (it prints a stack
and aborts) and asyncio leaves SIGTERM at its default action after
``asyncio.run``, so the command installs it again after each.  Worker
processes that their parent stops ignore both (``ignore_stop_signals``), as
does a clean-up that must not be cut short (``stop_signals_ignored``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def closed_stdout_status() -> int:
    """What a command returns once the reader of its stdout has gone (``| head``): a BrokenPipeError.

    Points stdout at /dev/null, so that the interpreter does not fail once
    more flushing it at exit, and returns a shell's status for a process that
    SIGPIPE ended (141).
    """
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def stop_on_sigterm() -> None:
    """From now on SIGTERM raises ``KeyboardInterrupt``, as Ctrl-C does (main thread only), and so does
    SIGINT when the process started with it ignored.

    NOTE: a script's background job (``kvserve serve &``) starts with SIGINT ignored.  ``serve``'s loop
    heeds it anyway (asyncio's handler), so a ``kill -INT`` during start-up was lost while one a moment
    later stopped the server: SIGINT now stops it at every stage, as SIGTERM does.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises ``KeyboardInterrupt`` (``stop_on_sigterm``); after it, what it was."""
    with _handling(_raise_keyboard_interrupt, (signal.SIGTERM,)):
        yield


@asynccontextmanager
async def sigterm_cancels_task() -> AsyncIterator[None]:
    """Within the block SIGTERM cancels the running task, which then raises ``KeyboardInterrupt``.

    NOTE: what asyncio does for Ctrl-C.  A Python-level SIGTERM handler that
    raises (``stop_on_sigterm``) raises wherever the main thread is; inside an
    event loop that is gRPC's or Ray's machinery, and a live experiment died
    of SIGSEGV there 5 times in 6.  Here the loop cancels the task at an
    ``await`` instead, the block's clean-up runs, and the caller sees the
    interrupt as from Ctrl-C.  After the block SIGTERM is handled as before it.
    """
    task = asyncio.current_task()
    if threading.current_thread() is not threading.main_thread() or task is None:
        yield
        return
    loop = asyncio.get_running_loop()
    previous = signal.getsignal(signal.SIGTERM)
    received = False

    def on_sigterm() -> None:
        nonlocal received
        received = True
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        yield
    except asyncio.CancelledError:
        if received:
            raise KeyboardInterrupt from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def ignore_stop_signals() -> None:
    """From now on SIGINT and SIGTERM are ignored: for a worker process that its parent stops."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


@contextmanager
def stop_signals_ignored() -> Iterator[None]:
    """Within the block SIGINT and SIGTERM are ignored (a clean-up not to cut short); after it, what they were."""
    with _handling(signal.SIG_IGN, STOP_SIGNALS):
        yield


@contextmanager
def interrupts_deferred(on_interrupt: Callable[[], None] | None = None) -> Iterator[Callable[[], bool]]:
    """Within the block a first SIGINT or SIGTERM is recorded instead of raised; yields whether one came.

    ``on_interrupt`` is called when it comes (to tell the user to wait).  A
    second one raises ``KeyboardInterrupt`` at once, as a way out.  Outside
    the main thread, where Python delivers no signals, the block runs as is.
    """
    received = False

    def interrupted() -> bool:
        return received

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal received
        if received:
            raise KeyboardInterrupt
        received = True
        if on_interrupt is not None:
            on_interrupt()

    # Unless the block installs a handler of its own, which is then its to keep.
    with _handling(handler, STOP_SIGNALS, keep_replaced=True):
        yield interrupted


@contextmanager
def _handling(
    handler: Callable[[int, FrameType | None], Any] | int, signums: tuple[int, ...], *, keep_replaced: bool = False
) -> Iterator[None]:
    """Within the block ``handler`` handles ``signums``; after it, what handled them before.

    Outside the main thread, where Python delivers no signals and cannot
    install handlers, the block runs as is.  With ``keep_replaced``, a signal
    whose handler the block replaced keeps the block's.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum in signums}
    try:
        yield
    finally:
        for signum, before in previous.items():
            if keep_replaced and signal.getsignal(signum) is not handler:
                continue
            # A handler installed outside Python (getsignal gives None) cannot be put back; the default can.
            signal.signal(signum, signal.SIG_DFL if before is None else before)
