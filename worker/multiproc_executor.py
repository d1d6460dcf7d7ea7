"""Runs the ranks of one tensor-parallel replica in child processes.

Each rank is a spawned process holding a ``Worker``; they form a
torch.distributed group among themselves.  The parent sends every plan to
every rank over a pipe and collects one reply per rank (rank 0's carries the
samples), so a rank that fails is noticed instead of hanging the others.

After startup the pipes are touched by two threads of this executor only, never
by the caller's::

    caller:   launch(N) -> plans queue          result(N) <- results queue
    sender:   plans queue -> every rank's pipe -> step ids sent
    receiver: step ids sent -> every rank's reply -> results queue

NOTE: an exception raised in the caller while it waits (Ctrl-C, a signal
handler's timeout) then cannot leave half a message or an unread reply in a
pipe: the ranks finish the step, the receiver reads its replies, and the
caller's next ``result`` skips the results of the steps it gave up on.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import queue
import signal
import socket
import threading
import traceback
from multiprocessing.connection import Connection

from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult
from kvserve.worker.worker import Worker
from kvserve.worker.worker_config import WorkerConfig

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 600.0
_STEP_TIMEOUT_S = 600.0
# How often a caller waiting for a result wakes up, so that an exception from
# another thread (``_thread.interrupt_main``, a notebook's interrupt) reaches it.
_WAKE_INTERVAL_S = 0.1

_SPAWN_HINT = (
    "it never started: a spawned rank imports the main module first, and that failed. With "
    "tensor_parallel_size > 1, a script must create the LLM under `if __name__ == \"__main__\":` "
    "(the rank's traceback is in stderr)"
)


class WorkerProcessError(RuntimeError):
    """A rank failed or died; the replica cannot continue."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(config: WorkerConfig, conn: Connection) -> None:
    """Entry point of one rank: start, agree on the cache size, then serve plans."""
    # NOTE: Ctrl-C in a terminal reaches the whole process group; the parent
    # decides what an interrupt means, and the ranks keep serving it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        conn.send(("ok", None))  # started: the main module imported
        worker = Worker(config)
        conn.send(("ok", worker.determine_num_blocks()))
        worker.initialize_cache(conn.recv())
        conn.send(("ok", None))
        while True:
            plan = conn.recv()
            if plan is None:
                break
            conn.send(("ok", worker.execute(plan)))
        worker.shutdown()
    except EOFError:
        pass
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class MultiprocExecutor:
    """An ``Executor`` whose ``tp_size`` ranks run in separate processes.

    Once a rank fails or dies, every later call raises ``WorkerProcessError`` naming it.
    """

    def __init__(self, config: WorkerConfig) -> None:
        init_method = config.distributed_init_method or f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[mp.process.BaseProcess] = []
        self._threads: list[threading.Thread] = []
        self._failure: WorkerProcessError | None = None
        try:
            for rank in range(config.tp_size):
                parent, child = ctx.Pipe()
                rank_config = dataclasses.replace(config, rank=rank, distributed_init_method=init_method)
                proc = ctx.Process(target=_rank_main, args=(rank_config, child), daemon=True,
                                   name=f"kvserve-rank{rank}")
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            self._gather(_STARTUP_TIMEOUT_S, exit_hint=_SPAWN_HINT)
            num_blocks = min(self._gather(_STARTUP_TIMEOUT_S))
            for conn in self._conns:
                conn.send(num_blocks)
            self._gather(_STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self._num_blocks = num_blocks
        self._plans: queue.SimpleQueue[StepPlan | None] = queue.SimpleQueue()
        self._sent_step_ids: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        # The step id of each plan the sender wrote to the ranks' pipes, or failed to (``_send`` waits for it).
        self._sent_or_failed: queue.SimpleQueue[int] = queue.SimpleQueue()
        # (step id, rank 0's result or the error), in the order the plans were sent.
        self._results: queue.SimpleQueue[tuple[int, StepResult | WorkerProcessError]] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._send_plans, name="kvserve-plan-sender", daemon=True),
            threading.Thread(target=self._receive_replies, name="kvserve-reply-receiver", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def num_kv_blocks(self) -> int:
        return self._num_blocks

    def execute(self, plan: StepPlan) -> StepResult:
        self._send(plan)
        return self._receive(plan.step_id)

    @property
    def launches_ahead(self) -> bool:
        """The ranks run in their own processes: the next plan is made while they run this one."""
        return True

    def launch(self, plan: StepPlan) -> PendingRankReplies:
        """Send ``plan`` to every rank; its result comes from ``result()`` (an ``OverlappingExecutor``).

        The ranks take plans in order: a plan sent while they still run the previous
        one waits in their pipes, so they start it without a round trip to this process.
        """
        self._send(plan)
        return PendingRankReplies(self, plan.step_id)

    def _send(self, plan: StepPlan) -> None:
        """Hand ``plan`` to the sender thread, and wait until it wrote it to the ranks' pipes.

        NOTE: the wait blocks, which gives the sender the GIL at once: without it, a caller
        that goes on planning (async scheduling, its previous result already there) kept
        the plan from the ranks for up to the interpreter's 5 ms switch interval.  The
        writes stay on the sender thread, so an interrupt never cuts one in half.
        """
        self._check_ranks()
        self._plans.put(plan)
        while True:
            try:
                done = self._sent_or_failed.get(timeout=_WAKE_INTERVAL_S)
            except queue.Empty:
                continue
            if done >= plan.step_id:  # smaller: a plan whose wait an exception ended
                return

    def _receive(self, step_id: int) -> StepResult:
        """Rank 0's reply to step ``step_id`` (after every rank's).

        The results of earlier steps still queued are those of steps whose caller gave
        up on them (an exception while it waited): they are dropped.
        """
        while True:
            try:
                result_step_id, outcome = self._results.get(timeout=_WAKE_INTERVAL_S)
            except queue.Empty:
                continue
            if result_step_id < step_id:
                continue
            if isinstance(outcome, WorkerProcessError):
                raise WorkerProcessError(str(outcome))
            if result_step_id > step_id:
                raise RuntimeError(f"step {step_id}'s result was asked for, but it was never sent")
            return outcome

    def _check_ranks(self) -> None:
        """``WorkerProcessError`` if a rank failed or exited since startup."""
        if self._failure is None:
            for rank, proc in enumerate(self._procs):
                if proc.exitcode is not None:
                    self._failure = WorkerProcessError(
                        f"rank {rank} exited unexpectedly (exit code {proc.exitcode})"
                    )
                    break
        if self._failure is not None:
            raise WorkerProcessError(f"{self._failure}; this replica cannot continue")

    def _send_plans(self) -> None:
        """The sender thread: every plan to every rank, in order."""
        while (plan := self._plans.get()) is not None:
            if self._failure is None:
                try:
                    for rank, conn in enumerate(self._conns):
                        try:
                            conn.send(plan)
                        except OSError:  # BrokenPipeError: the rank is gone
                            raise self._rank_exited(rank) from None
                except Exception as exc:  # noqa: BLE001 - the caller gets it, as a WorkerProcessError
                    self._failure = _as_worker_process_error(exc, f"sending step {plan.step_id}")
            if self._failure is not None:
                self._results.put((plan.step_id, self._failure))
            else:
                self._sent_step_ids.put(plan.step_id)
            self._sent_or_failed.put(plan.step_id)
        self._sent_step_ids.put(None)
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass

    def _receive_replies(self) -> None:
        """The receiver thread: every rank's reply to every plan sent, in order."""
        while (step_id := self._sent_step_ids.get()) is not None:
            if self._failure is None:
                try:
                    result = self._gather(_STEP_TIMEOUT_S)[0]
                    if result.step_id != step_id:
                        raise WorkerProcessError(f"rank 0 answered step {result.step_id} to step {step_id}")
                    self._results.put((step_id, result))
                    continue
                except Exception as exc:  # noqa: BLE001 - the caller gets it, as a WorkerProcessError
                    self._failure = _as_worker_process_error(exc, f"receiving step {step_id}")
            self._results.put((step_id, self._failure))

    def _gather(self, timeout_s: float, exit_hint: str | None = None) -> list:
        replies = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(timeout_s):
                raise WorkerProcessError(f"rank {rank} did not answer within {timeout_s:.0f} s")
            try:
                status, payload = conn.recv()
            except EOFError:
                raise self._rank_exited(rank, exit_hint) from None
            if status != "ok":
                raise WorkerProcessError(f"rank {rank} failed:\n{payload}")
            replies.append(payload)
        return replies

    def _rank_exited(self, rank: int, hint: str | None = None) -> WorkerProcessError:
        proc = self._procs[rank]
        proc.join(timeout=1.0)  # its pipe closed as it exited: the exit code follows at once
        message = f"rank {rank} exited unexpectedly (exit code {proc.exitcode})"
        return WorkerProcessError(f"{message}: {hint}" if hint else message)

    def shutdown(self) -> None:
        if self._threads:
            self._plans.put(None)  # the sender tells the ranks to stop, after the plans before it
        else:
            for conn in self._conns:
                try:
                    conn.send(None)
                except OSError:
                    pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for thread in self._threads:
            thread.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs, self._threads = [], [], []


def _as_worker_process_error(exc: Exception, doing: str) -> WorkerProcessError:
    if isinstance(exc, WorkerProcessError):
        return exc
    return WorkerProcessError(f"{doing} failed: {exc!r}")


@dataclasses.dataclass(slots=True)
class PendingRankReplies:
    """A plan sent to every rank of a ``MultiprocExecutor``; results are taken in launch order."""

    executor: MultiprocExecutor
    step_id: int

    def result(self) -> StepResult:
        return self.executor._receive(self.step_id)
