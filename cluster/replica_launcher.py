"""Starting one replica on the Ray cluster: placement, worker actors, rendezvous, KV cache.

``launch_replica`` is a coroutine that only awaits Ray object refs and gRPC
calls, so it runs the same from a driver's event loop and from inside an
async Ray actor (the scheduler actor)::

    handle = await launch_replica(0, WorkerConfig(model_dir, tp_size=2), device_kind="cpu")
    result = await handle.executor.execute(plan)
    await handle.shutdown()

Each launch makes a new random secret, which Ray hands to every rank (with
``start``) and which the replica's ``GrpcReplicaExecutor`` sends with each
call: the ranks' StepWorker servers refuse any other caller.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvserve.cluster.config import DEFAULT_STEP_TIMEOUT_S
from kvserve.cluster.placement import DEFAULT_PLACEMENT_TIMEOUT_S, DeviceKind, place_replica
from kvserve.cluster.replica_client import GrpcReplicaExecutor
from kvserve.cluster.worker_actor import (
    RAY_NAMESPACE,
    WORKER_CPU_RESOURCE,
    WorkerActor,
    worker_actor_name,
)
from kvserve.scheduler.executor import ReplicaFailedError
from kvserve.scheduler.simulation.simulated_worker import SimulatedWorkerConfig
from kvserve.worker.worker_config import WorkerConfig

logger = logging.getLogger(__name__)

# Loading weights onto a GPU can take minutes; a rank that never joins the
# others must not hang the launch forever.
DEFAULT_STARTUP_TIMEOUT_S = 600.0
_DEATH_TIMEOUT_S = 30.0
_PING_TIMEOUT_S = 10.0
# Starts of a replica's ranks whose rendezvous port another process took first (EADDRINUSE).
RENDEZVOUS_TRIES = 3

_RemoteWorkerActor = ray.remote(WorkerActor)


@dataclass(frozen=True, slots=True)
class ReplicaHandle:
    """A running replica: its executor, its rank actors (rank order) and their placement group."""

    replica_id: int
    executor: GrpcReplicaExecutor
    actors: list[ActorHandle]
    placement_group: PlacementGroup

    async def shutdown(self) -> None:
        """Release the workers (best effort when the replica failed) and kill the actors.

        On return the actors are dead: their names can be taken again by a
        replacement replica.
        """
        await self.executor.shutdown()
        self.kill()
        await _until_all_dead(self.actors, self.replica_id)

    def kill(self) -> None:
        """Kill every rank's actor and free the placement group; no graceful shutdown."""
        _kill(self.actors, self.placement_group)

    async def check_alive(self, timeout_s: float = _PING_TIMEOUT_S) -> None:
        """``ReplicaFailedError`` naming the rank if a rank's actor has died.

        Each rank's actor is pinged (an async actor answers even mid-step); one
        that does not answer within ``timeout_s`` counts as alive: a hung rank
        is the step timeout's to find.
        """
        pings = asyncio.gather(*(actor.ping.remote() for actor in self.actors), return_exceptions=True)
        try:
            outcomes = await asyncio.wait_for(pings, timeout_s)
        except asyncio.TimeoutError:
            return
        for rank, outcome in enumerate(outcomes):
            if isinstance(outcome, ActorDiedError):
                raise ReplicaFailedError(f"replica {self.replica_id} rank {rank}'s worker died: {outcome}")


async def launch_replica(
    replica_id: int,
    worker_config: WorkerConfig | SimulatedWorkerConfig,
    *,
    device_kind: DeviceKind | str,
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
    placement_timeout_s: float | None = DEFAULT_PLACEMENT_TIMEOUT_S,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    on_placed: Callable[[], None] | None = None,
    report_waiting_every_s: float | None = None,
) -> ReplicaHandle:
    """Start ``worker_config.tp_size`` ranks of ``replica_id`` on one node, ready to execute.

    ``worker_config`` is the template of every rank (its ``rank`` and
    ``distributed_init_method`` are set here).  ``device_kind`` ``"cpu"``
    places ranks on ``WORKER_CPU_RESOURCE`` slots and runs them on the CPU.
    A ``SimulatedWorkerConfig`` starts simulated ranks, which need no device
    and no rendezvous.  Raises ``PlacementError`` when no node has room,
    ``ReplicaFailedError`` when a rank fails to start; nothing is left
    running then.  ``on_placed`` is called once its node's resources are
    reserved, before its ranks start (load the model); ``report_waiting_every_s``: a WARNING
    this often while no node has room (``place_replica``).  ``step_timeout_s``: how
    long its ranks may take to answer a step before the replica fails
    (``ClusterConfig.step_timeout_s``: the scheduler actor passes it to every launch).
    """
    kind = DeviceKind(device_kind)
    simulated = isinstance(worker_config, SimulatedWorkerConfig)
    if kind is DeviceKind.CPU and not simulated and worker_config.device is None:
        worker_config = dataclasses.replace(worker_config, device="cpu")
    tp_size = worker_config.tp_size
    group = await place_replica(replica_id, tp_size, kind, placement_timeout_s, report_every_s=report_waiting_every_s)
    if on_placed is not None:
        on_placed()
    for attempt in range(1, RENDEZVOUS_TRIES + 1):
        actors: list[ActorHandle] = []
        secret = secrets.token_urlsafe(32)
        try:
            for rank in range(tp_size):
                actors.append(_create_actor(replica_id, rank, kind, group))
            rank_fields = {}
            if tp_size > 1 and not simulated:
                rank_fields["distributed_init_method"] = f"tcp://{await actors[0].rendezvous_address.remote()}"
            # NOTE: all ranks start at once: each blocks in torch.distributed's
            # rendezvous until every other rank has joined.
            starts = [
                actor.start.remote(dataclasses.replace(worker_config, rank=rank, **rank_fields), secret=secret)
                for rank, actor in enumerate(actors)
            ]
            addresses = await asyncio.wait_for(asyncio.gather(*starts), startup_timeout_s)
            executor = GrpcReplicaExecutor(replica_id, addresses, secret=secret, step_timeout_s=step_timeout_s)
            try:
                await executor.initialize_cache()
            except BaseException:
                await executor.shutdown()
                raise
            break
        except asyncio.TimeoutError:
            _kill(actors, group)
            raise ReplicaFailedError(f"replica {replica_id} did not start within {startup_timeout_s:.0f} s") from None
        except RayError as exc:
            # A rank's own exception reads better than Ray's wrapping of it (kept as __cause__).
            cause = exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc
            if attempt < RENDEZVOUS_TRIES and _port_taken(cause):
                # NOTE: rank 0's port was free when chosen, and another process bound it before rank 0 did.
                logger.warning("replica %d: its rendezvous port was taken before rank 0 bound it (try %d of %d): "
                               "starting its ranks again on another", replica_id, attempt, RENDEZVOUS_TRIES)
                _kill(actors, None)
                await _until_all_dead(actors, replica_id)
                continue
            _kill(actors, group)
            raise ReplicaFailedError(f"replica {replica_id} failed to start: {type(cause).__name__}: {cause}") from exc
        except BaseException:
            _kill(actors, group)
            raise
    logger.info("replica %d started: %d %s ranks at %s", replica_id, tp_size, kind.value, addresses)
    return ReplicaHandle(replica_id, executor, actors, group)


def _create_actor(replica_id: int, rank: int, kind: DeviceKind, group: PlacementGroup) -> ActorHandle:
    # The actor takes exactly its bundle: one GPU, or one worker slot.
    device_options = {"num_gpus": 1} if kind is DeviceKind.GPU else {"resources": {WORKER_CPU_RESOURCE: 1}}
    return _RemoteWorkerActor.options(
        name=worker_actor_name(replica_id, rank),
        namespace=RAY_NAMESPACE,
        num_cpus=0,
        max_restarts=0,
        # No record in Ray's GCS of each call (liveness checks, restarts): see the scheduler actor's.
        enable_task_events=False,
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
        **device_options,
    ).remote(replica_id, rank)


async def _until_dead(actor: ActorHandle) -> None:
    while True:
        try:
            await actor.ping.remote()
        except ActorDiedError:
            return
        except RayError:  # unavailable for now: ask again
            pass
        await asyncio.sleep(0.05)


def _port_taken(error: BaseException) -> bool:
    text = str(error)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


async def _until_all_dead(actors: list[ActorHandle], replica_id: int) -> None:
    """Wait until the killed ``actors`` are dead, their names free for a replacement (a warning after
    ``_DEATH_TIMEOUT_S``)."""
    try:
        await asyncio.wait_for(asyncio.gather(*(_until_dead(actor) for actor in actors)), _DEATH_TIMEOUT_S)
    except asyncio.TimeoutError:
        logger.warning("replica %d: workers still alive %.0f s after being killed", replica_id, _DEATH_TIMEOUT_S)


def _kill(actors: list[ActorHandle], group: PlacementGroup | None) -> None:
    """Kill ``actors``, and free ``group`` unless it is ``None`` (kept for their replacements)."""
    for actor in actors:
        ray.kill(actor, no_restart=True)
    if group is None:
        return
    try:
        remove_placement_group(group)
    except Exception as exc:  # noqa: BLE001 - already removed, or the cluster is going away
        logger.debug("placement group of %s: %s", group.id, exc)
