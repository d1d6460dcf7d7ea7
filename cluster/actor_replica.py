"""What the scheduler actor keeps per replica.

``ActorReplica`` is one replica as the actor drives it: its engine (scheduler and
executor), its step loop, the tasks that check, release or restart its workers, and what
monitoring tells of it (its counters, and how long its oldest step in flight has run).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from kvserve.cluster.host_port import split_host_port
from kvserve.cluster.messages import ReplicaStatsInfo
from kvserve.cluster.replica_launcher import ReplicaHandle
from kvserve.cluster.replica_restart import RestartBackoff, restart
from kvserve.scheduler.engine_core import EngineCore
from kvserve.scheduler.executor import AsyncExecutor, ReplicaFailedError
from kvserve.scheduler.request import Request
from kvserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

# A scheduler's monitoring counters: preemptions, prefix-cache queried and hit tokens.
Counts = tuple[int, int, int]


def started(request: Request) -> bool:
    """Whether a replica began computing ``request`` (it is no longer as it arrived): a failed
    replica's started requests move with their outputs, and only so many times."""
    return bool(request.num_computed_tokens or request.output_token_ids or request.num_preemptions)


class ActorReplica:
    """One replica as the actor drives it: its engine (scheduler and executor) and step loop.

    ``previous`` is the replica it replaces (started again after a failure): its
    counters go on from those of the replicas before it, and its restart backoff too.
    ``num_failures`` counts the times replica ``replica_id`` failed since the cluster
    started, ``num_restart_failures`` the tries to start it again that failed (the
    scheduler actor counts both).
    """

    def __init__(
        self, replica_id: int, scheduler: Scheduler, handle: ReplicaHandle, device_kind: str,
        previous: ActorReplica | None = None, *, async_scheduling: bool | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.scheduler = scheduler
        self.handle = handle
        self.device_kind = device_kind
        self.executor: AsyncExecutor = handle.executor
        self.engine = EngineCore(scheduler, handle.executor, async_scheduling=async_scheduling)
        self.healthy = True
        self.started_at = time.monotonic()
        self.wakeup = asyncio.Event()
        self.step_loop: asyncio.Task[None] | None = None
        self.idle_check: asyncio.Task[None] | None = None
        self.release_task: asyncio.Task[None] | None = None
        self.restart: asyncio.Task[None] | None = None
        self.retired: Counts = previous.counts() if previous is not None else (0, 0, 0)
        self.num_failures = previous.num_failures if previous is not None else 0
        self.num_restart_failures = previous.num_restart_failures if previous is not None else 0
        self.backoff = previous.backoff if previous is not None else RestartBackoff()
        # When each step in flight was sent (monotonic clock), oldest first.
        self.steps_sent_at: deque[float] = deque()

    def step_age_s(self) -> float:
        """How long its oldest step in flight has been running; 0 when none is (a hung worker's grows)."""
        sent_at = self.steps_sent_at
        return time.monotonic() - sent_at[0] if sent_at else 0.0

    def steps_applied(self) -> None:
        """Forget the send times of the steps its engine applied (those no longer in flight).

        The oldest left started to run when the one before it was answered, about now: its age
        counts from then, not from its sending (as its deadline does, ``GrpcReplicaExecutor``).
        """
        sent_at, num_applied = self.steps_sent_at, len(self.steps_sent_at) - self.engine.num_steps_in_flight
        for _ in range(num_applied):
            sent_at.popleft()
        if num_applied > 0 and sent_at:
            sent_at[0] = max(sent_at[0], time.monotonic())

    @property
    def restarting(self) -> bool:
        """Whether its workers are being started again (after its failure)."""
        return self.restart is not None and not self.restart.done()

    def check_idle(self, on_death: Callable[[str], None]) -> None:
        """Check in the background that the idle replica's workers live (``ReplicaHandle.check_alive``);
        ``on_death`` with the reason if one died, unless the replica failed meanwhile.  No check starts
        while one runs.

        NOTE: in the background because a hung worker's ping waits seconds: new work is not held up.
        """
        if self.idle_check is None or self.idle_check.done():
            self.idle_check = asyncio.create_task(self._check_alive(on_death), name=f"idle-check-r{self.replica_id}")

    async def _check_alive(self, on_death: Callable[[str], None]) -> None:
        try:
            await self.handle.check_alive()
        except ReplicaFailedError as exc:
            if self.healthy:
                on_death(f"replica {self.replica_id} failed while idle: {exc}")

    def take_out_of_service(self) -> None:
        """Mark it failed, its requests ended there and its cache gone (the actor moves its requests)."""
        self.healthy = False
        self.steps_sent_at.clear()
        # Keep the pool's books straight: every block goes back.
        self.scheduler.abort_requests(list(self.scheduler.requests))
        # Its KV cache is gone with its workers: the pool forgets every cached
        # block, and its event clears the replica from the router's index.
        self.scheduler.kv_cache_manager.reset_prefix_cache()
        # Its step loop ends.
        self.wakeup.set()

    def start_restart(
        self,
        *,
        launch: Callable[[], Awaitable[ReplicaHandle]],
        install: Callable[[ReplicaHandle], object],
        stopping: Callable[[], bool],
    ) -> None:
        """Start its workers again in the background (``replica_restart.restart``, which says how)."""
        self.restart = asyncio.create_task(
            restart(self, launch=launch, install=install, stopping=stopping), name=f"restart-r{self.replica_id}"
        )

    def release(self) -> asyncio.Task[None]:
        """Shut the replica's workers down, once, in the background."""
        if self.release_task is None:
            self.release_task = asyncio.create_task(self._shutdown_workers(), name=f"release-r{self.replica_id}")
        return self.release_task

    async def _shutdown_workers(self) -> None:
        try:
            await self.handle.shutdown()
        except Exception:  # noqa: BLE001 - a dead replica may fail to shut down
            logger.warning("replica %d did not shut down cleanly", self.replica_id, exc_info=True)

    def counts(self) -> Counts:
        """Preemptions, prefix-cache queried and hit tokens: its predecessors' and its scheduler's."""
        stats = self.scheduler.kv_cache_manager.prefix_cache_stats
        own = (self.scheduler.num_preemptions, stats.num_queried_tokens, stats.num_hit_tokens)
        return tuple(a + b for a, b in zip(self.retired, own))  # type: ignore[return-value]

    def hosts(self) -> str:
        """`` (its ranks ran on HOST, ...)`` for a failure's log line (which node was lost), or ``""``
        for an executor that names no addresses."""
        addresses = getattr(self.executor, "addresses", None)
        if not addresses:
            return ""
        return f" (its ranks ran on {', '.join(sorted({split_host_port(a)[0] for a in addresses}))})"

    def stats(self) -> ReplicaStatsInfo:
        """Its figures for ``GetStats``: its hit rate is that of the counters, its predecessors' included."""
        stats = self.scheduler.get_stats()
        preemptions, queried, hit = self.counts()
        return ReplicaStatsInfo(
            replica=self.replica_id,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_cache_usage=stats.kv_cache_usage,
            # NOTE: not the scheduler's own rate, which a restart set back to 0 while the
            # counters of /metrics went on: GetStats and /metrics tell the same hit rate.
            prefix_cache_hit_rate=hit / queried if queried else 0.0,
            num_kv_blocks=self.scheduler.cache_config.num_blocks,
            healthy=self.healthy,
            num_preemptions=preemptions,
            prefix_cache_queried_tokens=queried,
            prefix_cache_hit_tokens=hit,
            num_failures=self.num_failures,
            num_restart_failures=self.num_restart_failures,
            step_age_s=self.step_age_s(),
            cached_blocks_by_tenant=self.scheduler.kv_cache_manager.block_pool.cached_blocks_by_tenant(),
        )
