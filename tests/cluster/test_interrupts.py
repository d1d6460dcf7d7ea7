"""Ctrl-C held back during a start-up that must not be cut short."""

from __future__ import annotations

import signal
import threading

import pytest

from kvserve.cluster.interrupts import sigint_deferred


def send_sigint() -> None:
    # As Ctrl-C; Python runs the handler before raise_signal returns.
    signal.raise_signal(signal.SIGINT)


def test_a_first_ctrl_c_is_recorded_and_the_block_runs_to_its_end():
    told: list[str] = []
    finished = False
    with sigint_deferred(lambda: told.append("wait")) as interrupted:
        assert not interrupted()
        send_sigint()
        finished = True
    assert finished
    assert interrupted()
    assert told == ["wait"]


def test_a_second_ctrl_c_raises_at_once():
    with pytest.raises(KeyboardInterrupt):
        with sigint_deferred() as interrupted:
            send_sigint()
            assert interrupted()
            send_sigint()
            pytest.fail("the second Ctrl-C did not interrupt the block")


def test_the_previous_handler_is_back_after_the_block():
    before = signal.getsignal(signal.SIGINT)
    with sigint_deferred():
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(KeyboardInterrupt):
        send_sigint()


def test_outside_the_main_thread_the_block_runs_as_is():
    results: list[bool] = []

    def run() -> None:
        with sigint_deferred() as interrupted:
            results.append(signal.getsignal(signal.SIGINT) is signal.default_int_handler)
            results.append(interrupted())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert results == [True, False]
