"""The seam between a replica's scheduler and whatever runs its steps.

The real executors send plans to GPU (or CPU) workers, in process, in
sibling processes, or over gRPC; the simulated one answers after a modelled
step time.  The scheduler, block pool and router are the same in every case.
"""

from __future__ import annotations

from typing import Protocol

from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult


class Executor(Protocol):
    """Runs the steps of one replica."""

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the workers' paged KV cache, null block included (the pool's size)."""
        ...

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one forward pass of ``plan`` on every rank; rank 0's samples come back."""
        ...

    def shutdown(self) -> None:
        """Release the workers; the executor cannot be used afterwards."""
        ...


class PendingStep(Protocol):
    """A step an executor has started and not yet returned."""

    def result(self) -> StepResult | None:
        """Wait for the step; its samples (``None`` from a rank that does not sample)."""
        ...


class OverlappingExecutor(Executor, Protocol):
    """An executor that can start a step and return before it ends (overlapped scheduling)."""

    @property
    def launches_ahead(self) -> bool:
        """Whether the step runs elsewhere (a GPU, other processes) while ``launch`` returns, so
        that planning the next step hides behind it: async scheduling's default (``EngineCore``)."""
        ...

    def launch(self, plan: StepPlan) -> PendingStep:
        """Start ``plan``; the next plan's placeholder rows take this one's samples."""
        ...


class ReplicaFailedError(RuntimeError):
    """A replica's worker failed or died; its requests cannot continue there."""


class AsyncExecutor(Protocol):
    """Runs the steps of one replica from an asyncio event loop (the cluster's scheduler actor).

    ``execute`` raises ``ReplicaFailedError`` when any rank fails, dies or
    does not answer in time; the replica is then unusable.
    """

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the workers' paged KV cache, null block included."""
        ...

    async def execute(self, plan: StepPlan) -> StepResult: ...

    async def shutdown(self) -> None: ...


class PendingAsyncStep(Protocol):
    """A step an ``AsyncExecutor`` has sent and not yet returned."""

    async def result(self) -> StepResult: ...


class OverlappingAsyncExecutor(AsyncExecutor, Protocol):
    """An ``AsyncExecutor`` that can send a step before the previous one returned (overlapped scheduling)."""

    @property
    def launches_ahead(self) -> bool:
        """As ``OverlappingExecutor.launches_ahead``."""
        ...

    async def launch(self, plan: StepPlan) -> PendingAsyncStep:
        """Send ``plan``; the next plan's placeholder rows take this one's samples."""
        ...
