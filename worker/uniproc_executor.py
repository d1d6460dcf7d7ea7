"""Runs a single-rank replica's worker in the calling process."""

from __future__ import annotations

import torch

from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult
from kvserve.worker.worker import LaunchedStep, Worker
from kvserve.worker.worker_config import WorkerConfig


class UniprocExecutor:
    """An ``Executor`` for tensor-parallel size 1: the worker lives in this process.

    It is an ``OverlappingExecutor``: ``launch`` queues a step on the device and returns.
    On CPU with ``cpu_threads`` set, this process's torch thread count is the worker's
    until ``shutdown``, which gives back the count it found.
    """

    def __init__(self, config: WorkerConfig) -> None:
        if config.tp_size != 1:
            raise ValueError(f"UniprocExecutor runs one rank, got tp_size={config.tp_size}")
        # NOTE: torch's thread count is the process's; the worker sets it (cpu_threads).
        self._caller_num_threads = torch.get_num_threads()
        try:
            self.worker = Worker(config)
            self.worker.initialize_cache(self.worker.determine_num_blocks())
        except BaseException:
            torch.set_num_threads(self._caller_num_threads)
            raise

    @property
    def num_kv_blocks(self) -> int:
        return self.worker.num_blocks

    def execute(self, plan: StepPlan) -> StepResult:
        result = self.worker.execute(plan)
        if result is None:  # only non-driver ranks return None
            raise RuntimeError("the single rank did not return samples")
        return result

    @property
    def launches_ahead(self) -> bool:
        """On CUDA ``launch`` returns while the device runs the step; on CPU it runs it first."""
        return self.worker.launches_ahead

    def launch(self, plan: StepPlan) -> LaunchedStep:
        return self.worker.launch(plan)

    def shutdown(self) -> None:
        try:
            self.worker.shutdown()
        finally:
            torch.set_num_threads(self._caller_num_threads)
