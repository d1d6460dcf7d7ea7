"""A discrete-event simulator of a fleet of replicas on a virtual clock.

It drives the real control plane: one ``Scheduler`` (with its
``KVCacheManager`` and ``BlockPool``) per replica, every pool reporting to the
``Router``'s global prefix index, and the router's policy choosing where each
request goes.  Only the model is simulated: a step lasts
``cost_model.step_time(plan)`` and samples deterministic synthetic tokens.

Two kinds of events, in time order::

    arrival(t)        route the request, add it to its replica; an idle
                      replica starts a step at t
    step done(r, t)   update(plan, tokens) on replica r, record first tokens
                      and finishes, then r schedules its next step at t

Requests that arrive while a step runs join the next one (continuous
batching).  Arrivals come from the input in order; step completions from a
heap, so each event costs O(log replicas), not O(replicas).
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.request import Request
from kvserve.scheduler.routing.policy import RoutingPolicy
from kvserve.scheduler.routing.router import Router
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.simulation.cost_model import StepCostModel
from kvserve.scheduler.simulation.simulated_executor import synthetic_output_token_array
from kvserve.scheduler.step_plan import StepPlan

logger = logging.getLogger(__name__)


class SimulatedRequest(Protocol):
    """One request of a workload (``kvserve.bench.workloads.WorkloadRequest`` is one).

    ``output_token_ids``, when given, are the tokens the simulated model
    samples (a multi-turn workload puts them in the next turn's prompt);
    otherwise tokens are synthetic.  ``output_len`` tokens are generated,
    EOS ignored.
    """

    @property
    def arrival_time(self) -> float: ...
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def output_len(self) -> int: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def output_token_ids(self) -> Sequence[int] | None: ...


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """The simulated fleet: ``num_replicas`` identical replicas."""

    num_replicas: int
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    cost_model: StepCostModel
    vocab_size: int = 32_000

    def __post_init__(self) -> None:
        if isinstance(self.num_replicas, bool) or not isinstance(self.num_replicas, int) or self.num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive integer, got {self.num_replicas!r}")
        if self.vocab_size < 4:
            raise ValueError(f"vocab_size must be >= 4, got {self.vocab_size}")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What happened to one request; times in virtual seconds."""

    index: int
    arrival_time: float
    first_token_time: float
    finish_time: float
    replica_id: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    num_preemptions: int

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float:
        return self.finish_time - self.arrival_time


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """Every request's record (in input order) and per-replica totals."""

    policy: str
    records: list[RequestRecord]
    replica_busy_time: list[float]
    replica_num_steps: list[int]
    replica_num_requests: list[int]
    end_time: float
    wall_time: float = field(compare=False)


@dataclass(slots=True)
class _LiveRequest:
    index: int
    request: Request
    replica_id: int
    output_token_ids: Sequence[int]
    output_len: int
    num_output_tokens: int = 0
    first_token_time: float | None = None


ProgressCallback = Callable[[int, int], None]


class FleetSimulator:
    """Simulates ``config.num_replicas`` replicas routed by ``policy``; one ``run`` per instance."""

    def __init__(self, config: FleetConfig, policy: RoutingPolicy) -> None:
        self.config = config
        self.router = Router(
            config.num_replicas,
            policy,
            config.cache_config.block_size,
            model_id=config.cache_config.model_id,
            enable_prefix_caching=config.cache_config.enable_prefix_caching,
        )
        with _cyclic_gc_paused():
            self.schedulers = [
                Scheduler(config.scheduler_config, config.cache_config, observer=self.router.observer_for(r))
                for r in range(config.num_replicas)
            ]
        for replica_id, scheduler in enumerate(self.schedulers):
            self.router.update_load(replica_id, scheduler.get_load())
        self._used = False

    def run(
        self,
        requests: Sequence[SimulatedRequest],
        *,
        progress: ProgressCallback | None = None,
        progress_every: int = 0,
    ) -> SimulationResult:
        """Simulate ``requests`` (sorted by arrival time) to completion.

        ``progress(num_finished, num_requests)`` is called every
        ``progress_every`` finished requests (default: every 1%).  Raises
        ``ValueError`` for unsorted arrivals, a request no replica can hold or
        that needs more than ``max_model_len`` tokens, or times beyond the
        virtual clock's precision.
        """
        if self._used:
            raise ValueError("a FleetSimulator runs once; make a new one")
        self._used = True
        with _cyclic_gc_paused():
            return self._run(requests, progress, progress_every)

    def _run(
        self,
        requests: Sequence[SimulatedRequest],
        progress: ProgressCallback | None,
        progress_every: int,
    ) -> SimulationResult:
        wall_start = time.perf_counter()
        num_requests = len(requests)
        num_replicas = self.config.num_replicas
        cost_model = self.config.cost_model
        vocab_size = self.config.vocab_size
        max_model_len = self.config.scheduler_config.max_model_len
        schedulers = self.schedulers
        router = self.router
        plans: list[StepPlan | None] = [None] * num_replicas
        busy_time = [0.0] * num_replicas
        num_steps = [0] * num_replicas
        num_routed = [0] * num_replicas
        live: dict[str, _LiveRequest] = {}
        records: list[RequestRecord | None] = [None] * num_requests
        completions: list[tuple[float, int, int]] = []
        params_by_len: dict[int, SamplingParams] = {}
        sequence = 0
        num_finished = 0
        every = progress_every or max(1, num_requests // 100)
        now = 0.0

        def start_step(replica_id: int) -> None:
            nonlocal sequence
            scheduler = schedulers[replica_id]
            plan = None
            while scheduler.has_unfinished_requests():
                plan = scheduler.schedule()
                if plan.req_ids:
                    break
                if not plan.preempted_req_ids:
                    raise RuntimeError(f"replica {replica_id} has requests but cannot schedule any")
                # Everything running was preempted: the next plan admits from the front.
            router.update_load(replica_id, scheduler.get_load())
            if plan is None or not plan.req_ids:
                plans[replica_id] = None
                return
            plans[replica_id] = plan
            duration = cost_model.step_time(plan)
            end = now + duration
            if not end < math.inf or (end == now and duration > 0):
                # Beyond a float's precision, steps would take no time and figures come out inf or nan.
                raise ValueError(
                    f"the virtual clock cannot count a {duration:g} s step from {now:g} s: arrival times or "
                    "step costs too large"
                )
            busy_time[replica_id] += duration
            num_steps[replica_id] += 1
            sequence += 1
            heapq.heappush(completions, (end, sequence, replica_id))

        def finish_step(replica_id: int) -> None:
            nonlocal num_finished
            plan = plans[replica_id]
            if plan is None:
                raise RuntimeError(f"replica {replica_id} finished a step it never started")
            tokens: list[int] = []
            finished: list[_LiveRequest] = []
            # NOTE: every sampled row's request is running (nothing aborts in a
            # simulation), so update() appends each token: first tokens and
            # finishes are known here without reading its outputs.
            for req_id, sample in zip(plan.req_ids, plan.sample):
                if sample:
                    entry = live[req_id]
                    num_output = entry.num_output_tokens
                    tokens.append(entry.output_token_ids[num_output])
                    if num_output == 0:
                        entry.first_token_time = now
                    num_output += 1
                    entry.num_output_tokens = num_output
                    if num_output == entry.output_len:
                        finished.append(entry)
            schedulers[replica_id].update(plan, tokens, collect_outputs=False)
            for entry in finished:
                request = entry.request
                if not request.is_finished:
                    raise RuntimeError(f"request {request.req_id} did not finish after {entry.output_len} tokens")
                del live[request.req_id]
                records[entry.index] = RequestRecord(
                    index=entry.index,
                    arrival_time=request.arrival_time,
                    first_token_time=entry.first_token_time,  # type: ignore[arg-type]
                    finish_time=now,
                    replica_id=entry.replica_id,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_cached_tokens=request.num_cached_tokens or 0,
                    num_output_tokens=request.num_output_tokens,
                    num_preemptions=request.num_preemptions,
                )
                num_finished += 1
                if progress is not None and num_finished % every == 0:
                    progress(num_finished, num_requests)
            start_step(replica_id)

        def admit(index: int, item: SimulatedRequest) -> None:
            output_len = item.output_len
            params = params_by_len.get(output_len)
            if params is None:
                params = params_by_len[output_len] = SamplingParams(max_tokens=output_len, ignore_eos=True)
            req_id = str(index)
            num_prompt_tokens = len(item.prompt_token_ids)
            if num_prompt_tokens + output_len > max_model_len:
                # The scheduler would stop it short of output_len tokens.
                raise ValueError(
                    f"request {index} cannot be served: {num_prompt_tokens} prompt + {output_len} output tokens "
                    f"exceed max_model_len={max_model_len}"
                )
            output_token_ids = item.output_token_ids
            if output_token_ids is None:
                output_token_ids = synthetic_output_token_array(req_id, num_prompt_tokens, output_len, vocab_size)
            elif len(output_token_ids) < output_len:
                raise ValueError(
                    f"request {index} gives {len(output_token_ids)} output tokens but asks for {output_len}"
                )
            request = Request(
                req_id,
                item.prompt_token_ids,
                params,
                cache_salt=item.cache_salt,
                arrival_time=item.arrival_time,
            )
            replica_id = router.route(request)
            try:
                schedulers[replica_id].add_request(request)
            except ValueError as exc:
                raise ValueError(f"request {index} cannot be served: {exc}") from None
            live[req_id] = _LiveRequest(index, request, replica_id, output_token_ids, output_len)
            num_routed[replica_id] += 1
            if plans[replica_id] is None:
                start_step(replica_id)
            else:
                router.update_load(replica_id, schedulers[replica_id].get_load())

        next_index = 0
        last_arrival = float("-inf")
        while True:
            if next_index < num_requests:
                item = requests[next_index]
                arrival = item.arrival_time
                if completions and completions[0][0] <= arrival:
                    now, _, replica_id = heapq.heappop(completions)
                    finish_step(replica_id)
                    continue
                if arrival < last_arrival:
                    raise ValueError(
                        f"requests must be sorted by arrival time: request {next_index} arrives at "
                        f"{arrival} after one at {last_arrival}"
                    )
                last_arrival = now = arrival
                admit(next_index, item)
                next_index += 1
            elif completions:
                now, _, replica_id = heapq.heappop(completions)
                finish_step(replica_id)
            else:
                break
        if live:
            raise RuntimeError(f"{len(live)} requests never finished (a replica stalled)")
        if progress is not None and num_finished % every != 0:
            progress(num_finished, num_requests)
        wall_time = time.perf_counter() - wall_start
        logger.info(
            "simulated %d requests on %d replicas (%s) in %.1f s",
            num_requests, num_replicas, router.policy.name, wall_time,
        )
        return SimulationResult(
            policy=router.policy.name,
            records=records,  # type: ignore[arg-type]  # every slot is filled once all finished
            replica_busy_time=busy_time,
            replica_num_steps=num_steps,
            replica_num_requests=num_routed,
            end_time=now,
            wall_time=wall_time,
        )


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cycle collector for the duration (as it was, afterwards).

    NOTE: a fleet is millions of long-lived objects (every replica's blocks),
    and a simulation allocates a few per token, so the collector's periodic
    full passes re-scan the fleet for nothing: a simulation makes no reference
    cycles per step (refcounting frees its garbage).  Pausing it saves about
    a tenth of the run.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
