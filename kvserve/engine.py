"""The engine core of one replica: the scheduler driving an executor, step by step."""

from __future__ import annotations

from collections.abc import Iterable

from kvserve.scheduler.executor import Executor
from kvserve.scheduler.request import Request
from kvserve.scheduler.request_output import RequestOutput
from kvserve.scheduler.scheduler import Scheduler


class EngineCore:
    """``schedule()`` → ``execute()`` → ``update()``, one step at a time."""

    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, req_ids: Iterable[str]) -> list[Request]:
        return self.scheduler.abort_requests(req_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the tokens it produced."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        # NOTE: a plan with no scheduled request still goes out when it
        # carries finished or preempted ids, so that workers drop their state.
        try:
            result = self.executor.execute(plan)
        except BaseException:
            # NOTE: the plan's blocks were cached when it was scheduled, and its
            # KV was never written: a later request would hit them and read garbage.
            self.scheduler.discard_step(plan)
            raise
        return self.scheduler.update(plan, result.sampled_token_ids, result.logprobs)

    def shutdown(self) -> None:
        self.executor.shutdown()
