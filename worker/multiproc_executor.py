"""Runs the ranks of one tensor-parallel replica in child processes.

Each rank is a spawned process holding a ``Worker``; they form a
torch.distributed group among themselves.  The parent sends every plan to
every rank over a pipe and collects one reply per rank (rank 0's carries the
samples), so a rank that fails is noticed instead of hanging the others.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import socket
import traceback
from collections import deque
from multiprocessing.connection import Connection

from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult
from kvserve.worker.worker import Worker, WorkerConfig

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 600.0
_STEP_TIMEOUT_S = 600.0


class WorkerProcessError(RuntimeError):
    """A rank failed or died; the replica cannot continue."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(config: WorkerConfig, conn: Connection) -> None:
    """Entry point of one rank: start, agree on the cache size, then serve plans."""
    try:
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
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class MultiprocExecutor:
    """An ``Executor`` whose ``tp_size`` ranks run in separate processes."""

    def __init__(self, config: WorkerConfig) -> None:
        init_method = config.distributed_init_method or f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[mp.process.BaseProcess] = []
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
            num_blocks = min(self._gather(_STARTUP_TIMEOUT_S))
            for conn in self._conns:
                conn.send(num_blocks)
            self._gather(_STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self._num_blocks = num_blocks
        # Step ids of the plans sent and not yet answered, oldest first.
        self._in_flight: deque[int] = deque()

    @property
    def num_kv_blocks(self) -> int:
        return self._num_blocks

    def _gather(self, timeout_s: float) -> list:
        replies = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(timeout_s):
                raise WorkerProcessError(f"rank {rank} did not answer within {timeout_s:.0f} s")
            try:
                status, payload = conn.recv()
            except EOFError:
                raise WorkerProcessError(f"rank {rank} exited unexpectedly") from None
            if status != "ok":
                raise WorkerProcessError(f"rank {rank} failed:\n{payload}")
            replies.append(payload)
        return replies

    def execute(self, plan: StepPlan) -> StepResult:
        self._send(plan)
        return self._receive(plan.step_id)

    def launch(self, plan: StepPlan) -> PendingRankReplies:
        """Send ``plan`` to every rank; its result comes from ``result()`` (an ``OverlappingExecutor``).

        The ranks take plans in order: a plan sent while they still run the previous
        one waits in their pipes, so they start it without a round trip to this process.
        """
        self._send(plan)
        return PendingRankReplies(self, plan.step_id)

    def _send(self, plan: StepPlan) -> None:
        for conn in self._conns:
            conn.send(plan)
        self._in_flight.append(plan.step_id)

    def _receive(self, step_id: int) -> StepResult:
        """Rank 0's reply to step ``step_id``, the oldest in flight (after every rank's)."""
        if not self._in_flight or self._in_flight[0] != step_id:
            raise RuntimeError(f"step {step_id}'s result was asked for before those of {list(self._in_flight)}")
        self._in_flight.popleft()
        return self._gather(_STEP_TIMEOUT_S)[0]

    def shutdown(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []


@dataclasses.dataclass(slots=True)
class PendingRankReplies:
    """A plan sent to every rank of a ``MultiprocExecutor``; results are taken in launch order."""

    executor: MultiprocExecutor
    step_id: int

    def result(self) -> StepResult:
        return self.executor._receive(self.step_id)
