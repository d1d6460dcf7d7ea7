"""The scheduler actor (``kvserve-scheduler``): routing and the step loops of every replica.

One asyncio actor owns a ``Router`` and, per replica, an ``EngineCore``: a
``Scheduler`` (with its block pool) and an executor that sends each step to the
replica's workers.
The router is wired as in the simulator: every pool reports its cached blocks
to the router's global prefix index, and every change of a replica's queues
updates the router's load table, so live routing decides as simulated routing
does.  Each replica runs its own step loop, concurrently with the others::

    while healthy:  plan = begin_step()  →  await engine.run_step_async(plan)
                    (asleep on an asyncio.Event while the replica has nothing to do)

With ``async_scheduling`` the loop sends step N+1 to the workers before it awaits
step N (``EngineCore``), so the step protocol's round trip hides behind their work.

The front end adds and aborts requests and fetches what the steps produced
with ``poll_outputs``: one remote call returns every token of every request
since the previous call, so traffic between the two is per batch of steps,
never per token.

A replica whose executor fails is marked unhealthy (unavailable to the router,
its cached blocks forgotten) and new requests go to the others.  Its requests
move to the others too: those it had not started as they arrived, those it was
computing with their prompt and the tokens they produced so far (a preempted
request's state), so that their streams go on without a gap or a repeat.  A
request it had started moves at most ``MAX_MOVES_PER_REQUEST`` times (one of them may be what
broke the replica); past that, or when no replica can take it, it ends with an
error.  The failed replica's workers are stopped and started again on the same
kind of resources, with backoff between tries and no limit on their number
(``replica_restart``; a crash-looping replica waits longer each time); it then
rejoins routing with an empty cache.  Each failure is one ERROR line, with its
cause and what became of the replica's requests.  While no replica is available
and one is starting again (a total outage), new requests and moving ones wait for
it in this actor, up to ``max_queue_wait_s`` (``ClusterConfig``; see ``replica_wait_queue``):
``add_request`` returns ``None`` for one that waits, and its end comes as a delta.

A failure is found at once when a step fails, within ``IDLE_CHECK_S`` when an idle
replica's worker died (``ReplicaHandle.check_alive``, in the background: a hung worker's
ping waits seconds, and new work does not), and, when a worker hangs, once a step ran
``step_timeout_s``; meanwhile the age of its oldest step in flight (``step_age_s``) shows it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Iterable, Sequence
from functools import partial
from typing import Any

from ray.util.placement_group import PlacementGroup

from kvserve.cluster.actor_replica import ActorReplica, started
from kvserve.cluster.config import ClusterConfig
from kvserve.cluster.log_format import show_logs
from kvserve.cluster.messages import ClusterStatsInfo, ModelInfo, OutputBatch, ReplicaStatsInfo, RequestSpec
from kvserve.cluster.output_mailbox import OutputMailbox
from kvserve.cluster.output_watchdog import watch_undelivered_outputs
from kvserve.cluster.replica_launcher import ReplicaHandle, launch_replica
from kvserve.cluster.replica_restart import STILL_WAITING_REPORT_S
from kvserve.cluster.replica_wait_queue import ReplicaWaitQueue, WaitingRequest
from kvserve.scheduler.executor import ReplicaFailedError
from kvserve.scheduler.request import Request
from kvserve.scheduler.request_output import RequestOutput
from kvserve.scheduler.routing.load import NoAvailableReplicaError
from kvserve.scheduler.routing.router import Router
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.worker.model_config import ModelConfig

logger = logging.getLogger(__name__)

SCHEDULER_ACTOR_NAME = "kvserve-scheduler"
# How often an idle replica's workers are checked (see the module docstring).
IDLE_CHECK_S = 2.0
# Recovery of a failed replica (see the module docstring).
MAX_MOVES_PER_REQUEST = 2


class SchedulerActor:
    """Routes requests to replicas and steps every replica; run as a Ray async actor.

    Start-up: ``start_replica(r)`` for every replica (concurrently is fine),
    then ``ready()``.  The front end is the only caller of ``add_request``,
    ``abort_requests`` and ``poll_outputs`` (a single consumer: see ``OutputMailbox``).
    ``log_level``, when given, is the level of the actor's log lines (``show_logs``): the server's.
    """

    def __init__(self, config: ClusterConfig, model_config: ModelConfig, log_level: int | None = None) -> None:
        if log_level is not None:
            show_logs(log_level)
        self.config = config
        self.model_config = model_config
        self._scheduler_config = config.scheduler_config(model_config.max_model_len)
        # NOTE: the block size and model id of every replica's
        # CacheConfig (``config.cache_config``), so that the router's hashes are the pools'.
        self._router = Router(
            config.parallel.num_replicas,
            config.routing_policy(),
            config.engine.cache.block_size,
            model_id=model_config.model_id,
        )
        # A replica is routed to once it runs (start_replica).
        for replica_id in range(config.parallel.num_replicas):
            self._router.set_available(replica_id, False)
        self._replicas: dict[int, ActorReplica] = {}
        self._starting: set[int] = set()
        # Those of them whose resources are reserved: their workers are starting.
        self._placed: set[int] = set()
        # Requests in flight, by id: the replica serving each, and the request.
        self._requests: dict[str, tuple[ActorReplica, Request]] = {}
        # What the steps produced, until the front end polls it.
        self._outputs = OutputMailbox()
        self._watchdog: asyncio.Task[None] | None = None
        self._shutting_down = False
        # How many times each request in flight moved off a failed replica.
        self._num_moves: dict[str, int] = {}
        # Requests waiting for a replica while none is available (see the module docstring).
        self._waiting = ReplicaWaitQueue(config.max_queue_wait_s, route=self._queue, end=self._end_waiting)
        # Monitoring: every routing decision by how much of the prompt the chosen replica held.
        self._routing_outcomes: Counter[str] = Counter()

    # -- start-up --------------------------------------------------------------

    async def start_replica(self, replica_id: int, device_kind: str) -> ReplicaStatsInfo:
        """Launch replica ``replica_id``'s workers (``device_kind`` "gpu" or "cpu") and start its step loop."""
        num_replicas = self.config.parallel.num_replicas
        if not 0 <= replica_id < num_replicas:
            raise ValueError(f"replica_id must be in [0, {num_replicas}), got {replica_id}")
        if replica_id in self._replicas or replica_id in self._starting:
            raise ValueError(f"replica {replica_id} is already started")
        if self._shutting_down:
            raise RuntimeError("the scheduler is shutting down")
        self._starting.add(replica_id)
        try:
            handle = await self._launch(replica_id, device_kind, on_placed=lambda: self._placed.add(replica_id))
        finally:
            self._starting.discard(replica_id)
            self._placed.discard(replica_id)
        if self._shutting_down:
            await handle.shutdown()
            raise RuntimeError(f"the scheduler shut down while replica {replica_id} started")
        return self._install_replica(replica_id, handle, device_kind).stats()

    def _launch(self, replica_id: int, device_kind: str, **kwargs: Any) -> Awaitable[ReplicaHandle]:
        """``launch_replica`` of replica ``replica_id`` as this config says; ``kwargs`` go to it."""
        return launch_replica(
            replica_id,
            self.config.worker_config(self.model_config.max_model_len),
            device_kind=device_kind,
            placement_timeout_s=self.config.placement_timeout_s,
            step_timeout_s=self.config.step_timeout_s,
            **kwargs,
        )

    def _install_replica(self, replica_id: int, handle: ReplicaHandle, device_kind: str) -> ActorReplica:
        """Put a launched replica (new, or started again after a failure) into service."""
        previous = self._replicas.get(replica_id)
        num_kv_blocks = handle.executor.num_kv_blocks
        scheduler = Scheduler(
            self._scheduler_config,
            self.config.cache_config(num_kv_blocks, self.model_config.model_id),
            observer=self._router.observer_for(replica_id),
            queue_observer=self._router.queue_observer_for(replica_id),
        )
        # A replacement's counters and restart backoff go on from its predecessor's.
        replica = ActorReplica(
            replica_id, scheduler, handle, device_kind, previous,
            async_scheduling=self.config.engine.runtime.async_scheduling,
        )
        self._replicas[replica_id] = replica
        self._router.update_load(replica_id, scheduler.get_load())
        self._router.set_available(replica_id, True)
        replica.step_loop = asyncio.create_task(self._step_loop(replica), name=f"step-loop-r{replica_id}")
        if self._watchdog is None:
            timeout_s = self.config.undelivered_output_timeout_s
            watch = watch_undelivered_outputs(self._outputs, timeout_s, partial(self._abort, deliver=False))
            self._watchdog = asyncio.create_task(watch, name="output-watchdog")
        logger.info("replica %d ready: %d KV blocks", replica_id, num_kv_blocks)
        self._waiting.route_all()
        return replica

    async def placed_replicas(self) -> list[int]:
        """The replicas still starting whose resources are reserved: their workers load the model."""
        return sorted(self._placed)

    async def placement_groups(self) -> list[PlacementGroup]:
        """The placement group of every started replica (for a forced clean-up: they outlive this actor)."""
        return [replica.handle.placement_group for _, replica in sorted(self._replicas.items())]

    async def ready(self) -> ModelInfo:
        """What the front end needs to know of the model; ``RuntimeError`` before any replica started."""
        if not any(replica.healthy for replica in self._replicas.values()):
            raise RuntimeError("no replica is running")
        model = self.model_config
        return ModelInfo(
            model_dir=model.model_dir,
            vocab_size=model.vocab_size,
            max_model_len=model.max_model_len,
            eos_token_ids=model.eos_token_ids,
            num_replicas=len(self._replicas),
            simulated=self.config.simulation is not None,
        )

    # -- requests --------------------------------------------------------------

    async def add_request(self, spec: RequestSpec) -> int | None:
        """Route ``spec`` to a healthy replica and queue it there; returns the replica id, or
        ``None`` while it waits for one (none is available, one is starting again).

        ``ValueError`` for a request id already in flight or a request that can
        never fit the replica; ``RuntimeError`` (``NoAvailableReplicaError``)
        when no replica is healthy and none is starting again (or ``max_queue_wait_s`` is 0).
        """
        if self._shutting_down:
            raise RuntimeError("the scheduler is shutting down")
        req_id = spec.req_id
        if req_id in self._requests or req_id in self._outputs.pending or req_id in self._waiting:
            raise ValueError(f"request_id {req_id!r} is already in flight")
        request = self._new_request(req_id, spec.prompt_token_ids, spec.sampling_params, spec.cache_salt, tenant=spec.tenant)
        return self._queue_or_wait(request)

    def _new_request(
        self, req_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, cache_salt: str | None,
        **kwargs: Any,
    ) -> Request:
        """A ``Request`` stopping at the model's EOS ids; ``kwargs`` go to ``Request``."""
        eos_token_ids = self.model_config.eos_token_ids
        return Request(req_id, prompt_token_ids, sampling_params, eos_token_ids=eos_token_ids, cache_salt=cache_salt,
                       **kwargs)

    def _queue_or_wait(self, request: Request, moved_from: int | None = None, reason: str | None = None) -> int | None:
        """``_queue``, or, when no replica is available and one is starting again, ``None``: ``request``
        waits for it.  ``moved_from``: the replica it moves off, which failed with ``reason``."""
        try:
            return self._queue(request)
        except NoAvailableReplicaError as exc:
            may_wait = any(replica.restarting for replica in self._replicas.values())
            if not may_wait or self.config.max_queue_wait_s == 0:
                raise
            why = str(exc) if reason is None else f"{reason}; no other replica took it: {exc}"
            self._waiting.add(request, why, moved_from)
            return None

    def _queue(self, request: Request) -> int:
        """Route ``request`` and queue it on the chosen replica; returns the replica id."""
        # Hashes the prompt into request.block_hashes, which the replica's cache manager reuses.
        replica = self._replicas[self._router.route(request)]
        try:
            replica.scheduler.add_request(request)
        except ValueError as exc:
            # The prompt's length is checked against max_model_len by the front
            # end; what is left is its KV footprint, the prompt's own or with max_tokens.
            field = "sampling_params.max_tokens" if replica.scheduler.prompt_fits_pool(request) else "prompt"
            raise ValueError(f"{field}: {exc}") from None
        self._update_load(replica)
        self._requests[request.req_id] = (replica, request)
        self._routing_outcomes[self._router.outcome(request, replica.replica_id)] += 1
        replica.wakeup.set()
        return replica.replica_id

    async def cluster_stats(self) -> ClusterStatsInfo:
        """The routing policy's name, how many requests it routed by outcome, and how many wait for a replica."""
        return ClusterStatsInfo(self.config.routing, dict(self._routing_outcomes), len(self._waiting))

    async def add_requests(self, specs: Sequence[RequestSpec]) -> list[int | None | Exception]:
        """``add_request`` for each of ``specs`` in one remote call (a front end batches the
        requests that arrive together): the replica id of each (``None``: it waits for one),
        or the ``ValueError`` / ``RuntimeError`` it was refused with.
        """
        results: list[int | None | Exception] = []
        for spec in specs:
            try:
                results.append(await self.add_request(spec))
            except (ValueError, RuntimeError) as exc:
                results.append(exc)
        return results

    async def abort_requests(self, req_ids: Sequence[str]) -> None:
        """Stop these requests and free their blocks; unknown or finished ids are ignored.

        Each aborted request still gets a last delta (``finish_reason="abort"``).
        """
        self._abort(req_ids, deliver=True)

    async def poll_outputs(self, timeout_s: float = 1.0) -> OutputBatch:
        """Every request's new tokens since the previous poll, one delta per request.

        Waits up to ``timeout_s`` for at least one; returns an empty batch if none came,
        or if a newer poll came meanwhile (then it takes them).
        """
        pending = await self._outputs.take(timeout_s)
        if pending is None:
            # NOTE: a newer poll came while this one waited: this one's caller is gone (a front
            # end that stopped or died mid-poll); the outputs are the newer one's.
            pending = {}
        return OutputBatch.from_deltas(
            (output.to_delta(req_id) for req_id, output in pending.items()),
            num_healthy_replicas=self._num_healthy(),
        )

    def _num_healthy(self) -> int:
        return sum(replica.healthy for replica in self._replicas.values())

    async def get_stats(self) -> list[ReplicaStatsInfo]:
        return [replica.stats() for _, replica in sorted(self._replicas.items())]

    async def shutdown(self) -> None:
        """End every request with an error, stop the step loops and release the workers."""
        if self._shutting_down:
            return
        self._shutting_down = True
        for replica in self._replicas.values():
            if replica.healthy:
                self._fail_replica(replica, "the cluster is shutting down", release=False)
        self._waiting.end_all("the cluster is shutting down")
        tasks = [t for r in self._replicas.values() for t in (r.step_loop, r.idle_check, r.restart) if t is not None]
        if self._watchdog is not None:
            tasks.append(self._watchdog)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(r.release() for r in self._replicas.values()))
        logger.info("scheduler shut down")

    # -- the step loop ---------------------------------------------------------

    async def _step_loop(self, replica: ActorReplica) -> None:
        engine = replica.engine
        while replica.healthy:
            plan = engine.begin_step()
            # NOTE: recorded after the schedule, as the simulator does: this is
            # the load the router sees while the step runs.  It follows every
            # finish_step() too: no await separates it from this begin_step().
            self._update_load(replica)
            if plan is None and not engine.step_in_flight:
                # NOTE: no await between begin_step() and clear(): an add_request
                # cannot slip in between and lose its wake-up.
                replica.wakeup.clear()
                try:
                    await asyncio.wait_for(replica.wakeup.wait(), IDLE_CHECK_S)
                except asyncio.TimeoutError:
                    replica.check_idle(on_death=partial(self._fail_replica, replica))
                continue
            # NOTE: the plan goes out now; with async scheduling, after those launched before, if any.
            if plan is not None:
                replica.steps_sent_at.append(time.monotonic())
            try:
                # With async scheduling: launch this plan, apply the oldest in flight (EngineCore.steps_ahead).
                outputs = await engine.run_step_async(plan)
            except asyncio.CancelledError:
                raise
            except ReplicaFailedError as exc:
                self._fail_replica(replica, f"replica {replica.replica_id} failed: {exc}")
                return
            except Exception as exc:  # noqa: BLE001 - nothing may crash the actor
                self._fail_replica(replica, f"replica {replica.replica_id} failed: {exc!r}", bug=exc)
                return
            if not replica.healthy:  # its idle check found a dead worker while the step ran: its requests moved
                return
            replica.steps_applied()
            if outputs:
                self._collect(replica, outputs)

    def _collect(self, replica: ActorReplica, outputs: list[RequestOutput]) -> None:
        entry_of = self._outputs.entry
        requests = self._requests
        for output in outputs:
            req_id = output.req_id
            _, request = requests[req_id]
            entry_of(req_id, replica.replica_id).add(output, request)
            if output.finish_reason is not None:
                del requests[req_id]
                self._num_moves.pop(req_id, None)
        self._outputs.notify()

    # -- failures and lost outputs ---------------------------------------------

    def _abort(self, req_ids: Iterable[str], *, deliver: bool) -> None:
        by_replica: dict[int, list[str]] = {}
        num_ended = 0
        for req_id in req_ids:
            entry = self._requests.pop(req_id, None)
            if entry is not None:
                replica, request = entry
                replica_id: int | None = replica.replica_id
                by_replica.setdefault(replica.replica_id, []).append(req_id)
            elif (waiting := self._waiting.pop(req_id)) is not None:
                request, replica_id = waiting.request, waiting.replica
            else:
                continue
            self._num_moves.pop(req_id, None)
            num_ended += 1
            if deliver:
                self._outputs.entry(req_id, replica_id).finish(request, reason="abort")
            else:
                self._outputs.pending.pop(req_id, None)
        for replica_id, ids in by_replica.items():
            replica = self._replicas[replica_id]
            replica.scheduler.abort_requests(ids)
            self._update_load(replica)
            # The next plan tells the workers to drop these requests.
            replica.wakeup.set()
        if deliver and num_ended:
            self._outputs.notify()

    def _fail_replica(
        self, replica: ActorReplica, reason: str, *, release: bool = True, bug: Exception | None = None
    ) -> None:
        """Take ``replica`` out of service, move its requests to the others and start it again.

        Unless the cluster is shutting down, its requests are routed again or wait for a replica
        (see the module docstring); those that cannot move end with ``reason`` as
        their error.  ``bug``: an unexpected exception, logged with its traceback.
        """
        if not replica.healthy:  # failed already: its idle check found a dead worker while a step ran
            return
        if not self._shutting_down:
            replica.num_failures += 1
        self._router.set_available(replica.replica_id, False)
        # Taken before they all end there: each as it arrived plus what it produced (a preempted request's
        # state), and whether it had started (was computed there: it may be what broke the replica).
        mine = [(self._resumed(request), started(request)) for r, request in self._requests.values() if r is replica]
        replica.take_out_of_service()
        self._update_load(replica)
        if release:
            # NOTE: before its requests move: while it restarts, they may wait for it.
            replica.release()
            if not self._shutting_down and replica.restart is None:
                replica_id, device_kind = replica.replica_id, replica.device_kind
                replica.start_restart(
                    launch=lambda: self._launch(replica_id, device_kind, report_waiting_every_s=STILL_WAITING_REPORT_S),
                    install=lambda handle: self._install_replica(replica_id, handle, device_kind),
                    stopping=lambda: self._shutting_down,
                )
        num_failed, num_waiting = 0, len(self._waiting)
        for request, was_started in mine:
            req_id = request.req_id
            del self._requests[req_id]
            error = self._move(request, was_started, replica.replica_id, reason)
            if error is None:
                continue
            self._num_moves.pop(req_id, None)
            self._outputs.entry(req_id, replica.replica_id).finish(request, error=error)
            num_failed += 1
        num_waiting = len(self._waiting) - num_waiting
        if not self._shutting_down:
            # NOTE: the incident's one error line: the executor logs its failure at DEBUG only.
            waiting = f"{num_waiting} wait for a replica, " if num_waiting else ""
            outcome = f"; {len(mine) - num_failed - num_waiting} of its requests moved to other replicas, {waiting}"
            logger.error("%s%s%s", reason, replica.hosts(), f"{outcome}{num_failed} failed" if mine else "", exc_info=bug)
        if num_failed:
            self._outputs.notify()

    def _resumed(self, request: Request) -> Request:
        """``request`` as it arrived (its hashes and arrival time kept), plus what it produced."""
        resumed = self._new_request(
            request.req_id, request.prompt_token_ids, request.sampling_params, request.cache_salt,
            arrival_time=request.arrival_time, block_hashes=request.block_hashes, tenant=request.tenant,
        )
        for token_id in request.output_token_ids:
            resumed.append_output_token(token_id)
        resumed.num_cached_tokens, resumed.prompt_logprobs = request.num_cached_tokens, request.prompt_logprobs
        return resumed

    def _move(self, request: Request, started: bool, moved_from: int, reason: str) -> str | None:
        """Queue ``request`` (``_resumed``) again elsewhere, or let it wait for a replica (``moved_from``
        failed with ``reason``); ``None``, or why it could not move."""
        if self._shutting_down:
            return reason
        num_moves = self._num_moves.get(request.req_id, 0)
        if started and num_moves >= MAX_MOVES_PER_REQUEST:
            return f"{reason}; it had moved {num_moves} times already"
        try:
            self._queue_or_wait(request, moved_from, reason)
        except (ValueError, RuntimeError) as exc:
            return f"{reason}; no other replica took it: {exc}"
        if started:
            self._num_moves[request.req_id] = num_moves + 1
        return None

    def _end_waiting(self, waiting: WaitingRequest, error: str) -> None:
        """End a request that waited for a replica with ``error``."""
        self._num_moves.pop(waiting.request.req_id, None)
        self._outputs.entry(waiting.request.req_id, waiting.replica).finish(waiting.request, error=error)
        self._outputs.notify()

    def _update_load(self, replica: ActorReplica) -> None:
        """Tell the router ``replica``'s current load (after its queues changed)."""
        self._router.update_load(replica.replica_id, replica.scheduler.get_load())
