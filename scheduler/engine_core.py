"""The step loop of one replica: ``schedule()`` -> the executor -> ``update()``.

Every replica runs this loop, wherever it runs; the executor is the only seam::

    in-process LLM     step()                                   Uniproc- / MultiprocExecutor
    calibration        step()                                   the same, timed by a wrapper
    cluster replica    begin_step(), await run_step_async()     gRPC to the workers (async)
    fleet simulator    begin_step() ... finish_step()           none: the step cost model
                                                                sets the virtual time between

``begin_step`` and ``finish_step`` are the loop's two halves, for drivers that await the
executor or let virtual time pass between them.

Overlapped (asynchronous) scheduling, ``async_scheduling=True`` with an executor that can
``launch`` a step without waiting for it: each ``step()`` plans and launches step N+1, then
waits for step N and applies it, so the host's planning hides behind the device's work.
``None`` (the default) turns it on where the executor ``launches_ahead`` (a GPU, ranks in other
processes, the cluster's workers), and off where the step would run in the caller's thread
anyway (one CPU rank in process) and planning ahead would only add work::

    step():  begin_step(N+1), launch(N+1)  |  N.result(), finish_step(N)  ->  N's outputs

Requests sampled by step N are planned into N+1 with placeholders for their new token
(see ``Scheduler``).  ``run_step_async`` is the same loop for executors awaited on an
event loop.

``steps_ahead`` is how many launched steps a call leaves unapplied: 1 above.  An executor
whose round trip is long may ask for more (its ``steps_ahead`` attribute; the cluster's gRPC
executor asks for 2): with two steps queued at the workers, they start the next one as soon as
they finish one, and the scheduler's round trip (answer, apply, plan, send) runs in parallel
with the workers' step rather than between two of them::

    step():  begin_step(N+2), launch(N+2)  |  N.result(), finish_step(N)   (N+1 still in flight)

Plain Python: no torch, Ray or gRPC.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from kvserve.scheduler.executor import AsyncExecutor, Executor, PendingAsyncStep, PendingStep
from kvserve.scheduler.request import Request
from kvserve.scheduler.request_output import RequestOutput
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult


class EngineCore:
    """One replica's scheduler driving its executor, one step at a time."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor | AsyncExecutor | None = None,
        *,
        async_scheduling: bool | None = None,
        steps_ahead: int | None = None,
    ) -> None:
        can_launch = callable(getattr(executor, "launch", None))
        if async_scheduling is None:
            async_scheduling = can_launch and bool(getattr(executor, "launches_ahead", False))
        elif async_scheduling and not can_launch:
            raise ValueError(f"async_scheduling needs an executor that can launch steps, got {executor!r}")
        if steps_ahead is None:
            steps_ahead = getattr(executor, "steps_ahead", 1)
        if isinstance(steps_ahead, bool) or not isinstance(steps_ahead, int) or steps_ahead < 1:
            raise ValueError(f"steps_ahead must be an integer >= 1, got {steps_ahead!r}")
        self.scheduler = scheduler
        self.executor = executor
        # NOTE: both may be switched between steps while nothing is in flight (benchmarks compare them).
        self.async_scheduling = async_scheduling
        self.steps_ahead = steps_ahead
        # The steps launched and not yet applied, oldest first (async scheduling).
        self._in_flight: deque[tuple[StepPlan, PendingStep | PendingAsyncStep]] = deque()

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, req_ids: Iterable[str]) -> list[Request]:
        return self.scheduler.abort_requests(req_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def begin_step(self) -> StepPlan | None:
        """Schedule the next step; ``None`` when there is nothing to send.

        NOTE: a plan with no scheduled request is still returned when it carries
        finished or preempted ids, so that workers drop their state.
        """
        plan = self.scheduler.schedule()
        return None if plan.is_empty else plan

    def finish_step(self, plan: StepPlan, result: StepResult, *, collect_outputs: bool = True) -> list[RequestOutput]:
        """Apply ``plan``'s sampled tokens; the outputs of the requests that got one."""
        logprobs = None
        if result.logprobs is not None and collect_outputs:
            logprobs = result.logprobs.per_sampled_row(len(result.sampled_token_ids))
        return self.scheduler.update(plan, result.sampled_token_ids, logprobs,
                                     prompt_logprobs=result.prompt_logprobs, collect_outputs=collect_outputs)

    def fail_step(self, plan: StepPlan) -> None:
        """``plan`` never ran: abort its requests and uncache the blocks it was to fill.

        NOTE: its blocks were cached when it was scheduled, and their KV was never
        written: a later request would hit them and read garbage.
        """
        self.scheduler.discard_step(plan)

    def step(self) -> list[RequestOutput]:
        """Run one step on a synchronous executor; returns the tokens it produced.

        With async scheduling, the tokens of the step launched ``steps_ahead`` calls before
        (none while the steps in flight are fewer).
        """
        if self.async_scheduling:
            return self._overlapped_step()
        plan = self.begin_step()
        if plan is None:
            return []
        try:
            result = self.executor.execute(plan)  # type: ignore[union-attr]
        except BaseException:
            self.fail_step(plan)
            raise
        return self.finish_step(plan, result)

    def _overlapped_step(self) -> list[RequestOutput]:
        plan = self.begin_step()
        if plan is not None:
            try:
                launched = self.executor.launch(plan)  # type: ignore[union-attr]
            except BaseException:
                self._fail_launch(plan)
                raise
            self._in_flight.append((plan, launched))
        oldest = self._oldest_to_apply(plan)
        if oldest is None:
            return []
        try:
            result = oldest[1].result()
        except BaseException:
            self._fail_launch(oldest[0])
            raise
        return self._finish_launched(oldest[0], result)

    @property
    def step_in_flight(self) -> bool:
        """Whether a launched step waits to be applied (async scheduling)."""
        return bool(self._in_flight)

    @property
    def num_steps_in_flight(self) -> int:
        """How many launched steps wait to be applied (at most ``steps_ahead`` between calls)."""
        return len(self._in_flight)

    async def run_step_async(self, plan: StepPlan | None) -> list[RequestOutput]:
        """Run ``plan`` (from ``begin_step``) on an ``AsyncExecutor``; the tokens it produced.

        With async scheduling, launch ``plan`` and apply the oldest step in flight, once more
        than ``steps_ahead`` are (``plan`` may be ``None`` then, to apply the oldest one):
        ``step()``'s overlap, for drivers on an event loop (the cluster's scheduler actor).
        """
        executor = self.executor
        if not self.async_scheduling:
            assert plan is not None
            try:
                result = await executor.execute(plan)  # type: ignore[union-attr, misc]
            except BaseException:
                self.fail_step(plan)
                raise
            return self.finish_step(plan, result)
        if plan is not None:
            try:
                launched = await executor.launch(plan)  # type: ignore[union-attr]
            except BaseException:
                self._fail_launch(plan)
                raise
            self._in_flight.append((plan, launched))
        oldest = self._oldest_to_apply(plan)
        if oldest is None:
            return []
        try:
            result = await oldest[1].result()
        except BaseException:
            self._fail_launch(oldest[0])
            raise
        return self._finish_launched(oldest[0], result)

    def _oldest_to_apply(self, plan: StepPlan | None) -> tuple[StepPlan, Any] | None:
        """The launched step to wait for and apply now, taken out of the steps in flight: the
        oldest, once more than ``steps_ahead`` are in flight, or whenever no plan was launched
        (nothing more to plan until tokens come back); ``None`` while the pipeline fills."""
        in_flight = self._in_flight
        if not in_flight or (plan is not None and len(in_flight) <= self.steps_ahead):
            return None
        return in_flight.popleft()

    def _finish_launched(self, plan: StepPlan, result: StepResult | None) -> list[RequestOutput]:
        if result is None:
            raise RuntimeError(f"step {plan.step_id} returned no samples")
        return self.finish_step(plan, result)

    def _fail_launch(self, plan: StepPlan) -> None:
        """``plan`` failed to launch or to return: it and the steps in flight never ran."""
        self.fail_step(plan)
        while self._in_flight:
            self.fail_step(self._in_flight.popleft()[0])

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()

