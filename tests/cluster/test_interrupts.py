"""Ctrl-C and SIGTERM held back during a start-up that must not be cut short, and SIGTERM as Ctrl-C."""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest

from kvserve.cluster.interrupts import (
    interrupts_deferred,
    sigterm_as_interrupt,
    sigterm_cancels_task,
    stop_on_sigterm,
    stop_signals_ignored,
)


def send_sigint() -> None:
    # As Ctrl-C; Python runs the handler before raise_signal returns.
    signal.raise_signal(signal.SIGINT)


def test_a_first_ctrl_c_is_recorded_and_the_block_runs_to_its_end():
    told: list[str] = []
    finished = False
    with interrupts_deferred(lambda: told.append("wait")) as interrupted:
        assert not interrupted()
        send_sigint()
        finished = True
    assert finished
    assert interrupted()
    assert told == ["wait"]


def test_a_second_ctrl_c_raises_at_once():
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred() as interrupted:
            send_sigint()
            assert interrupted()
            send_sigint()
            pytest.fail("the second Ctrl-C did not interrupt the block")


def test_the_previous_handler_is_back_after_the_block():
    before = signal.getsignal(signal.SIGINT)
    before_term = signal.getsignal(signal.SIGTERM)
    with interrupts_deferred():
        assert signal.getsignal(signal.SIGINT) is not before
        assert signal.getsignal(signal.SIGTERM) is not before_term
    assert signal.getsignal(signal.SIGINT) is before
    assert signal.getsignal(signal.SIGTERM) is before_term
    with pytest.raises(KeyboardInterrupt):
        send_sigint()


@pytest.fixture
def sigterm_restored():
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.mark.usefixtures("sigterm_restored")
def test_sigterm_is_held_back_as_ctrl_c_is_and_a_second_one_raises():
    told: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred(lambda: told.append("wait")) as interrupted:
            signal.raise_signal(signal.SIGTERM)
            assert interrupted() and told == ["wait"]
            signal.raise_signal(signal.SIGTERM)
            pytest.fail("the second SIGTERM did not interrupt the block")


@pytest.mark.usefixtures("sigterm_restored")
def test_stop_on_sigterm_makes_sigterm_a_keyboard_interrupt():
    stop_on_sigterm()
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGTERM)


@pytest.mark.usefixtures("sigterm_restored")
def test_stop_on_sigterm_heeds_a_sigint_that_the_process_started_ignoring():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a script's background job starts
    try:
        stop_on_sigterm()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.usefixtures("sigterm_restored")
def test_sigterm_is_a_keyboard_interrupt_within_the_block_only():
    def mine(signum: int, frame: object) -> None:
        pass

    signal.signal(signal.SIGTERM, mine)
    with pytest.raises(KeyboardInterrupt):
        with sigterm_as_interrupt():
            signal.raise_signal(signal.SIGTERM)
            pytest.fail("SIGTERM did not interrupt the block")
    assert signal.getsignal(signal.SIGTERM) is mine
    with sigterm_as_interrupt():
        pass
    assert signal.getsignal(signal.SIGTERM) is mine


def test_outside_the_main_thread_the_block_runs_as_is():
    results: list[bool] = []

    def run() -> None:
        with interrupts_deferred() as interrupted:
            results.append(signal.getsignal(signal.SIGINT) is signal.default_int_handler)
            results.append(interrupted())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert results == [True, False]


@pytest.mark.usefixtures("sigterm_restored")
def test_stop_signals_are_ignored_within_the_block_only():
    def mine(signum: int, frame: object) -> None:
        raise AssertionError("the block let a stop signal through")

    signal.signal(signal.SIGTERM, mine)
    ctrl_c = signal.getsignal(signal.SIGINT)
    with stop_signals_ignored():
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is mine
    assert signal.getsignal(signal.SIGINT) is ctrl_c


def its_own(signum: int, frame: object) -> None:
    raise AssertionError("not to be called")


@pytest.mark.usefixtures("sigterm_restored")
def test_a_handler_the_deferring_block_installs_is_its_to_keep():
    ctrl_c = signal.getsignal(signal.SIGINT)
    with interrupts_deferred():
        signal.signal(signal.SIGTERM, its_own)
    assert signal.getsignal(signal.SIGTERM) is its_own
    assert signal.getsignal(signal.SIGINT) is ctrl_c


@pytest.mark.usefixtures("sigterm_restored")
def test_after_sigterm_as_interrupt_the_previous_handler_is_back_even_if_the_block_installed_one():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with sigterm_as_interrupt():
        signal.signal(signal.SIGTERM, its_own)  # as ray.init does
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_in_an_event_loop_sigterm_cancels_the_task_at_an_await_and_its_clean_up_runs():
    # The raising handler raised wherever the main thread was: inside gRPC's and Ray's
    # machinery, a live experiment died of SIGSEGV.
    steps: list[str] = []

    async def replay() -> None:
        async with sigterm_cancels_task():
            try:
                asyncio.get_running_loop().call_later(0.05, signal.raise_signal, signal.SIGTERM)
                await asyncio.sleep(10)
                steps.append("slept")
            finally:
                await asyncio.sleep(0)  # a clean-up that awaits still runs
                steps.append("cleaned up")

    with sigterm_as_interrupt():
        handler = signal.getsignal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(replay())
        assert steps == ["cleaned up"]
        assert signal.getsignal(signal.SIGTERM) is handler  # the raising one again, after the loop


def test_a_cancellation_that_is_not_sigterms_stays_a_cancellation():
    async def cancelled() -> None:
        async with sigterm_cancels_task():
            asyncio.current_task().cancel()  # type: ignore[union-attr]
            await asyncio.sleep(1)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancelled())
