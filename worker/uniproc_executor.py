"""Runs a single-rank replica's worker in the calling process."""

from __future__ import annotations

from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult
from kvserve.worker.worker import LaunchedStep, Worker, WorkerConfig


class UniprocExecutor:
    """An ``Executor`` for tensor-parallel size 1: the worker lives in this process.

    It is an ``OverlappingExecutor``: ``launch`` queues a step on the device and returns.
    """

    def __init__(self, config: WorkerConfig) -> None:
        if config.tp_size != 1:
            raise ValueError(f"UniprocExecutor runs one rank, got tp_size={config.tp_size}")
        self.worker = Worker(config)
        self.worker.initialize_cache(self.worker.determine_num_blocks())

    @property
    def num_kv_blocks(self) -> int:
        return self.worker.num_blocks

    def execute(self, plan: StepPlan) -> StepResult:
        result = self.worker.execute(plan)
        if result is None:  # only non-driver ranks return None
            raise RuntimeError("the single rank did not return samples")
        return result

    def launch(self, plan: StepPlan) -> LaunchedStep:
        return self.worker.launch(plan)

    def shutdown(self) -> None:
        self.worker.shutdown()
