"""Replicas that step on a virtual clock: a real ``Scheduler`` each, the model simulated.

A ``SimulatedReplicas`` holds some of a fleet's replicas (all of them, or one
process's share: ``FleetSimulator``), each an ``EngineCore`` without an executor
whose step halves run at virtual times.  A step lasts
``cost_model.step_time(plan)`` and samples the request's scripted or
synthetic tokens::

    add(request, replica, t)   the replica's scheduler takes it; an idle
                               replica starts a step at t
    advance(until)             every step that ends at or before ``until``
                               completes, in time order: update(plan, tokens),
                               first tokens and finishes recorded, and the
                               replica schedules its next step at that time

Requests added while a step runs join the next one (continuous batching).
Step completions come from a heap, so each costs O(log replicas).  The
replicas' pools and schedulers report to the observers given (KV-cache
events, queue events), and each replica's load, as it changes, to
``report_load``: that is all a router learns of them.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

from kvserve.scheduler.block_pool import KVCacheEventObserver
from kvserve.scheduler.engine_core import EngineCore
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.scheduler_load import SchedulerEventObserver, SchedulerLoad
from kvserve.scheduler.simulation.admission import TrackedRequest
from kvserve.scheduler.simulation.fleet import FleetConfig, RequestRecord
from kvserve.scheduler.simulation.simulated_executor import synthetic_output_token_array
from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult

ProgressCallback = Callable[[int, int], None]


class SimulatedReplicas:
    """Replicas ``replica_ids`` of the fleet ``config``, stepping on one virtual clock."""

    def __init__(
        self,
        config: FleetConfig,
        replica_ids: Sequence[int],
        observer_for: Callable[[int], KVCacheEventObserver],
        queue_observer_for: Callable[[int], SchedulerEventObserver],
        report_load: Callable[[int, SchedulerLoad], None],
    ) -> None:
        num_replicas = config.num_replicas
        self._cost_model = config.cost_model
        self._vocab_size = config.vocab_size
        self._report_load = report_load
        self._progress: ProgressCallback | None = None
        self._progress_every = 1
        self._num_requests = 0
        # Indexed by replica id, None for the fleet's other replicas.
        self._engines: list[EngineCore | None] = [None] * num_replicas
        for replica_id in replica_ids:
            scheduler = Scheduler(
                config.scheduler_config,
                config.cache_config,
                observer=observer_for(replica_id),
                queue_observer=queue_observer_for(replica_id),
            )
            self._engines[replica_id] = EngineCore(scheduler)
            report_load(replica_id, scheduler.get_load())
        self._plans: list[StepPlan | None] = [None] * num_replicas
        self.busy_time = [0.0] * num_replicas
        self.num_steps = [0] * num_replicas
        self.num_routed = [0] * num_replicas
        self.records: list[RequestRecord] = []
        # (end time, sequence, replica): the sequence orders steps that end together.
        self._completions: list[tuple[float, int, int]] = []
        self._sequence = 0
        # The time of the last event: a step's end, or an arrival.
        self.now = 0.0

    @property
    def num_finished(self) -> int:
        return len(self.records)

    def set_progress(self, progress: ProgressCallback | None, every: int, num_requests: int) -> None:
        """Call ``progress(num_finished, num_requests)`` every ``every`` requests these replicas finish."""
        self._progress = progress
        self._progress_every = every
        self._num_requests = num_requests

    def add(self, request: TrackedRequest, replica_id: int, now: float) -> None:
        """Replica ``replica_id`` takes ``request`` at time ``now``.

        It generates ``request.script``'s tokens (synthetic ones when None).
        Raises ``ValueError`` naming the request when the replica's scheduler
        refuses it.
        """
        engine = self._engines[replica_id]
        if engine is None:
            raise ValueError(f"replica {replica_id} is not one of these replicas")
        scheduler = engine.scheduler
        if request.script is None:
            request.script = synthetic_output_token_array(
                request.req_id, request.num_prompt_tokens, request.sampling_params.max_tokens, self._vocab_size
            )
        try:
            scheduler.add_request(request)
        except ValueError as exc:
            raise ValueError(f"request {request.index} cannot be served: {exc}") from None
        request.replica_id = replica_id
        self.now = now
        self.num_routed[replica_id] += 1
        if self._plans[replica_id] is None:
            self._start_step(replica_id)
        else:
            self._report_load(replica_id, scheduler.get_load())

    @property
    def next_step_end(self) -> float:
        """When the next step in flight ends (inf when none runs)."""
        return self._completions[0][0] if self._completions else math.inf

    def advance(self, until: float) -> None:
        """Complete, in time order, every step that ends at or before ``until``."""
        completions = self._completions
        heappop = heapq.heappop
        while completions and completions[0][0] <= until:
            now, _, replica_id = heappop(completions)
            self.now = now
            self._finish_step(replica_id)

    def check_all_finished(self) -> None:
        """Raise ``RuntimeError`` if a request added here has not finished (call after ``advance(inf)``)."""
        num_unfinished = sum(self.num_routed) - len(self.records)
        if num_unfinished:
            raise RuntimeError(f"{num_unfinished} requests never finished (a replica stalled)")

    def _start_step(self, replica_id: int) -> None:
        engine: EngineCore = self._engines[replica_id]  # type: ignore[assignment]
        plan = None
        while engine.has_unfinished_requests():
            plan = engine.begin_step()
            if plan is not None and plan.req_ids:
                break
            if plan is None or not plan.preempted_req_ids:
                raise RuntimeError(f"replica {replica_id} has requests but cannot schedule any")
            # Everything running was preempted: the next plan admits from the front.
        self._report_load(replica_id, engine.scheduler.get_load())
        if plan is None or not plan.req_ids:
            self._plans[replica_id] = None
            return
        self._plans[replica_id] = plan
        now = self.now
        duration = self._cost_model.step_time(plan)
        end = now + duration
        if not end < math.inf or (end == now and duration > 0):
            # Beyond a float's precision, steps would take no time and figures come out inf or nan.
            raise ValueError(
                f"the virtual clock cannot count a {duration:g} s step from {now:g} s: arrival times or "
                "step costs too large"
            )
        self.busy_time[replica_id] += duration
        self.num_steps[replica_id] += 1
        self._sequence += 1
        heapq.heappush(self._completions, (end, self._sequence, replica_id))

    def _finish_step(self, replica_id: int) -> None:
        plan = self._plans[replica_id]
        if plan is None:
            raise RuntimeError(f"replica {replica_id} finished a step it never started")
        now = self.now
        engine: EngineCore = self._engines[replica_id]  # type: ignore[assignment]
        requests: dict[str, TrackedRequest] = engine.scheduler.requests  # type: ignore[assignment]
        tokens: list[int] = []
        finished: list[TrackedRequest] = []
        # NOTE: every sampled row's request is running (nothing aborts in a
        # simulation), so update() appends each token: first tokens and
        # finishes are known here without reading its outputs.
        for req_id, sample in zip(plan.req_ids, plan.sample):
            if sample:
                request = requests[req_id]
                num_output = len(request.output_token_ids)
                tokens.append(request.script[num_output])  # type: ignore[index]
                if num_output == 0:
                    request.first_token_time = now
                if num_output + 1 == request.sampling_params.max_tokens:
                    finished.append(request)
        engine.finish_step(plan, StepResult(plan.step_id, tokens), collect_outputs=False)
        for request in finished:
            if not request.is_finished:
                raise RuntimeError(
                    f"request {request.req_id} did not finish after {request.sampling_params.max_tokens} tokens"
                )
            self.records.append(RequestRecord(
                index=request.index,
                arrival_time=request.arrival_time,
                first_token_time=request.first_token_time,  # type: ignore[arg-type]
                finish_time=now,
                replica_id=request.replica_id,
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens or 0,
                num_output_tokens=request.num_output_tokens,
                num_preemptions=request.num_preemptions,
            ))
            if self._progress is not None and len(self.records) % self._progress_every == 0:
                self._progress(len(self.records), self._num_requests)
        self._start_step(replica_id)
