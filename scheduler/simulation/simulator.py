"""A discrete-event simulator of a fleet of replicas on a virtual clock.

It drives the real control plane: one ``Scheduler`` (with its
``KVCacheManager`` and ``BlockPool``) per replica, every pool reporting to the
``Router``'s global prefix index, and the router's policy choosing where each
request goes.  Only the model is simulated: a step lasts
``cost_model.step_time(plan)`` and samples deterministic synthetic tokens
(``SimulatedReplicas``).

Two kinds of events, in time order::

    arrival(t)        route the request, add it to its replica; an idle
                      replica starts a step at t
    step done(r, t)   update(plan, tokens) on replica r, record first tokens
                      and finishes, then r schedules its next step at t

Requests that arrive while a step runs join the next one (continuous
batching).  Arrivals come from the input in order; step completions from a
heap, so each event costs O(log replicas), not O(replicas).

With ``processes=N`` the replicas are shared among this process and
``N - 1`` child processes, which step their replicas between arrivals in
parallel and report their pools' events to this process's router before
each arrival (``replica_shard``): the same results, record for record.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import multiprocessing
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.scheduler.cores import available_cores
from kvserve.scheduler.routing.policy import FleetSettingsPolicy, RoutingPolicy
from kvserve.scheduler.routing.router import Router
from kvserve.scheduler.simulation.admission import Admission
from kvserve.scheduler.simulation.fleet import FleetConfig, RequestRecord, SimulatedRequest
from kvserve.scheduler.simulation.replica_shard import (
    CLEARED,
    QUEUED,
    REMOVED,
    STORED,
    ReplicaShard,
    unpack_load,
)
from kvserve.scheduler.simulation.simulated_replicas import ProgressCallback, SimulatedReplicas

__all__ = ["FleetConfig", "FleetSimulator", "RequestRecord", "SimulatedRequest", "SimulationResult"]

logger = logging.getLogger(__name__)


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


class FleetSimulator:
    """Simulates ``config.num_replicas`` replicas routed by ``policy``; one ``run`` per instance.

    ``processes`` > 1 steps the replicas in that many processes (this one
    included; at most one per replica), for large fleets on several cores:
    ``run`` forks the others (so they inherit the workload) and stops them
    before it returns.  The results are the same as one process's.

    A policy built without a cost model or a step budget of its own (``FleetSettingsPolicy``:
    ``make_policy("cost_ttft")``) prices with ``config.cost_model``, the model the simulated
    steps take, and the replicas' ``max_num_batched_tokens``; what it was built with stays.
    """

    def __init__(self, config: FleetConfig, policy: RoutingPolicy, *, processes: int = 1) -> None:
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
            raise ValueError(f"processes must be a positive integer, got {processes!r}")
        if processes > 1 and "fork" not in multiprocessing.get_all_start_methods():
            raise ValueError("processes > 1 needs the fork start method, which this platform lacks")
        if isinstance(policy, FleetSettingsPolicy):
            policy.adopt_fleet(config.cost_model, config.scheduler_config.max_num_batched_tokens)
        self.config = config
        self.processes = min(processes, config.num_replicas)
        self.router = Router(
            config.num_replicas,
            policy,
            config.cache_config.block_size,
            model_id=config.cache_config.model_id,
        )
        # Replica r is process r % processes's (this one's: 0).
        self._owner = [r % self.processes for r in range(config.num_replicas)]
        with _cyclic_gc_paused():
            self.replicas = SimulatedReplicas(
                config,
                range(0, config.num_replicas, self.processes),
                self.router.observer_for,
                self.router.queue_observer_for,
                self.router.update_load,
            )
        # The observers that forward the shard processes' events to the index and the queue trackers.
        shard_replicas = [r for r in range(config.num_replicas) if self._owner[r]]
        self._shard_observers = {r: self.router.observer_for(r) for r in shard_replicas}
        self._shard_queue_observers = {r: self.router.queue_observer_for(r) for r in shard_replicas}
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
        ``progress_every`` finished requests (default: every 1%; with
        several processes, at the first arrival after each such count or,
        once all have arrived, the first step of this process's, and at the
        end).  Raises ``ValueError`` for unsorted arrivals, a request
        no replica can hold or that needs more than ``max_model_len`` tokens,
        or times beyond the virtual clock's precision.
        """
        if self._used:
            raise ValueError("a FleetSimulator runs once; make a new one")
        self._used = True
        wall_start = time.perf_counter()
        num_requests = len(requests)
        every = progress_every or max(1, num_requests // 100)
        with _cyclic_gc_paused():
            if self.processes == 1:
                records, end_time = self._run_here(requests, progress, every)
                if progress is not None and num_requests % every != 0:
                    progress(num_requests, num_requests)
            else:
                records, end_time = self._run_sharded(requests, progress, every)
        wall_time = time.perf_counter() - wall_start
        logger.info(
            "simulated %d requests on %d replicas (%s, %d processes) in %.1f s",
            num_requests, self.config.num_replicas, self.router.policy.name, self.processes, wall_time,
        )
        return SimulationResult(
            policy=self.router.policy.name,
            records=records,
            replica_busy_time=self.replicas.busy_time,
            replica_num_steps=self.replicas.num_steps,
            replica_num_requests=self.replicas.num_routed,
            end_time=end_time,
            wall_time=wall_time,
        )

    def _run_here(
        self, requests: Sequence[SimulatedRequest], progress: ProgressCallback | None, every: int
    ) -> tuple[list[RequestRecord], float]:
        replicas = self.replicas
        replicas.set_progress(progress, every, len(requests))
        admission = Admission(self.config)
        route = self.router.route
        last_arrival = -math.inf
        for index, item in enumerate(requests):
            arrival = item.arrival_time
            replicas.advance(arrival)
            last_arrival = _check_order(index, arrival, last_arrival)
            request = admission.request(index, item)
            replicas.add(request, route(request), arrival)
        replicas.advance(math.inf)
        replicas.check_all_finished()
        return _in_input_order(replicas.records, len(requests)), replicas.now

    def _run_sharded(
        self, requests: Sequence[SimulatedRequest], progress: ProgressCallback | None, every: int
    ) -> tuple[list[RequestRecord], float]:
        config = self.config
        replicas = self.replicas
        router = self.router
        owner = self._owner
        admission = Admission(config)
        shards: list[ReplicaShard] = []
        # Requests finished in each process (this one's: replicas.num_finished), and the total last reported.
        shard_finished = [0] * self.processes
        reported_count = 0

        def report() -> None:
            nonlocal reported_count
            num_finished = replicas.num_finished + sum(shard_finished)
            if num_finished // every > reported_count // every:
                reported_count = num_finished
                progress(num_finished, len(requests))  # type: ignore[misc]

        try:
            spin = self.processes <= available_cores()
            for process in range(1, self.processes):
                shards.append(
                    ReplicaShard(config, range(process, config.num_replicas, self.processes), requests, spin=spin)
                )
            for shard in shards:
                for replica_id, load in shard.initial_loads():
                    router.update_load(replica_id, unpack_load(load))
            outboxes: list[list] = [[] for _ in range(self.processes)]
            last_arrival = -math.inf
            for index, item in enumerate(requests):
                arrival = item.arrival_time
                last_arrival = _check_order(index, arrival, last_arrival)
                for shard, outbox in zip(shards, outboxes[1:]):
                    shard.send_step(outbox, arrival)
                    outbox.clear()
                replicas.advance(arrival)
                # While the shards step: the work on the request that needs no replica's state.
                request = admission.request(index, item)
                router.hash_prompt(request)
                for process, shard in enumerate(shards, 1):
                    events, inflight, loads, shard_finished[process] = shard.receive_step()
                    self._apply_shard_report(events, inflight, loads)
                if progress is not None:
                    report()
                replica_id = router.route(request)
                process = owner[replica_id]
                if process:
                    outboxes[process].append((index, replica_id, request.block_hashes))
                else:
                    replicas.add(request, replica_id, arrival)
            # The drain: every process runs its replicas to completion, the shards
            # sending their counts of finished requests as they go, read here
            # between this process's steps.
            for shard, outbox in zip(shards, outboxes[1:]):
                shard.send_finish(outbox, every)
            while replicas.next_step_end < math.inf:
                replicas.advance(replicas.next_step_end)
                if progress is not None:
                    for process, shard in enumerate(shards, 1):
                        count = shard.poll_progress()
                        if count is not None:
                            shard_finished[process] = count
                    report()
            replicas.check_all_finished()
            records = replicas.records
            end_time = replicas.now
            for process, shard in enumerate(shards, 1):

                def shard_progress(count: int, process: int = process) -> None:
                    shard_finished[process] = count
                    if progress is not None:
                        report()

                shard_records, totals, shard_end = shard.receive_finish(shard_progress)
                records.extend(shard_records)
                end_time = max(end_time, shard_end)
                for replica_id, busy_time, num_steps, num_routed in totals:
                    replicas.busy_time[replica_id] = busy_time
                    replicas.num_steps[replica_id] = num_steps
                    replicas.num_routed[replica_id] = num_routed
        finally:
            for shard in shards:
                shard.close()
        if progress is not None and reported_count != len(requests):
            progress(len(requests), len(requests))
        return _in_input_order(records, len(requests)), end_time

    def _apply_shard_report(
        self,
        events: list[tuple[int, int, Any]],
        inflight: list[tuple[int, int]],
        loads: list[tuple[int, tuple[int, ...]]],
    ) -> None:
        """Tell the router what a shard's replicas did since its last report.

        NOTE: pool and queue events in the order they happened, so that a queued
        request is looked up in the index as its replica's pool was at that moment.
        """
        observers = self._shard_observers
        queue_observers = self._shard_queue_observers
        for replica_id, code, payload in events:
            if code == STORED:
                observers[replica_id].blocks_stored(payload, [])
            elif code == REMOVED:
                observers[replica_id].blocks_removed(payload, [])
            elif code == CLEARED:
                observers[replica_id].all_blocks_cleared()
            elif code == QUEUED:
                queue_observers[replica_id].request_queued(*payload)
            else:  # DEQUEUED
                queue_observers[replica_id].request_dequeued(payload)
        for replica_id, num_prefill_tokens in inflight:
            queue_observers[replica_id].mirror_inflight_prefill_tokens(num_prefill_tokens)
        for replica_id, load in loads:
            self.router.update_load(replica_id, unpack_load(load))


def _check_order(index: int, arrival: float, last_arrival: float) -> float:
    if arrival < last_arrival:
        raise ValueError(
            f"requests must be sorted by arrival time: request {index} arrives at {arrival} after one at {last_arrival}"
        )
    return arrival


def _in_input_order(records: list[RequestRecord], num_requests: int) -> list[RequestRecord]:
    ordered: list[RequestRecord | None] = [None] * num_requests
    for record in records:
        ordered[record.index] = record
    return ordered  # type: ignore[return-value]  # every request finished: every slot is filled


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
