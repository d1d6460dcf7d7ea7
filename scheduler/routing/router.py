"""The router: hashes a request's prompt once, then lets the policy pick a replica.

It owns the global prefix index (fed by every replica pool through
``observer_for``), a ``QueueTracker`` per replica (fed by its scheduler's
queue and step events through ``queue_observer_for``), the replicas' load
table (fed by ``update_load`` whenever a replica's scheduler changes, merged
with its tracker's figures, and by ``set_available`` when a replica starts
or fails), and the policy.  The hashes it computes are stored on the
``Request``, so the chosen replica's cache manager reuses them.
"""

from __future__ import annotations

import logging

from kvserve.scheduler.block_hash import BlockHasher, num_cacheable_blocks
from kvserve.scheduler.block_pool import KVCacheEventObserver
from kvserve.scheduler.request import Request
from kvserve.scheduler.routing.load import LoadSnapshot, LoadTable, NoAvailableReplicaError
from kvserve.scheduler.routing.policy import RoutingPolicy, RoutingRequest
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex
from kvserve.scheduler.routing.queue_tracker import QueueTracker

logger = logging.getLogger(__name__)


class Router:
    """Routes requests among replicas ``0..num_replicas-1``.

    ``block_size`` and ``model_id`` must be the replicas' (``CacheConfig``),
    so that the router's hashes are the pools' hashes.  Every replica starts
    available; a caller that starts replicas one by one marks them
    unavailable until they run (``set_available``).
    """

    def __init__(
        self,
        num_replicas: int,
        policy: RoutingPolicy,
        block_size: int,
        *,
        model_id: str = "",
    ) -> None:
        self.policy = policy
        self.hasher = BlockHasher(block_size, model_id)
        self.index = GlobalPrefixIndex()
        self.loads = LoadTable(num_replicas)
        self._trackers = [QueueTracker(self.index, r, block_size) for r in range(num_replicas)]

    @property
    def num_replicas(self) -> int:
        return len(self.loads)

    def observer_for(self, replica_id: int) -> KVCacheEventObserver:
        """The observer to give replica ``replica_id``'s ``Scheduler`` (its pool)."""
        if not 0 <= replica_id < self.num_replicas:
            raise ValueError(f"replica_id must be in [0, {self.num_replicas}), got {replica_id}")
        return self.index.observer_for(replica_id)

    def queue_observer_for(self, replica_id: int) -> QueueTracker:
        """The ``SchedulerEventObserver`` to give replica ``replica_id``'s new ``Scheduler``.

        A new scheduler queues nothing: the tracker of an earlier one is forgotten.
        """
        if not 0 <= replica_id < self.num_replicas:
            raise ValueError(f"replica_id must be in [0, {self.num_replicas}), got {replica_id}")
        tracker = self._trackers[replica_id] = QueueTracker(self.index, replica_id, self.hasher.block_size)
        return tracker

    def update_load(self, replica_id: int, load: LoadSnapshot) -> None:
        """Record replica ``replica_id``'s load (``Scheduler.get_load()``) after it changed,
        with what its ``QueueTracker`` counted."""
        tracker = self._trackers[replica_id]
        self.loads.set(replica_id, load, tracker.num_queued_cached_tokens, tracker.num_inflight_prefill_tokens)

    def set_available(self, replica_id: int, available: bool) -> None:
        """Whether requests may be routed to ``replica_id``.

        Its cached blocks stay in the index (policies ignore them while it is
        unavailable).  A replica that failed has lost its KV cache: reset its
        pool's prefix cache (``KVCacheManager.reset_prefix_cache``), whose
        event clears it from the index.
        """
        if not 0 <= replica_id < self.num_replicas:
            raise ValueError(f"replica_id must be in [0, {self.num_replicas}), got {replica_id}")
        self.loads.set_available(replica_id, available)

    def route(self, request: Request) -> int:
        """The available replica for ``request``; fills ``request.block_hashes`` if it is empty.

        Raises ``NoAvailableReplicaError`` (a ``RuntimeError``) when no replica is available.
        """
        if not self.loads.num_available:
            raise NoAvailableReplicaError(f"none of the {self.num_replicas} replicas is available")
        self.hash_prompt(request)
        routing_request = RoutingRequest(
            req_id=request.req_id,
            block_hashes=request.block_hashes,
            num_prompt_tokens=request.num_prompt_tokens,
            block_size=self.hasher.block_size,
            cache_salt=request.cache_salt,
            max_output_tokens=request.sampling_params.max_tokens,
        )
        replica_id = self.policy.select(routing_request, self.loads, self.index)
        if not 0 <= replica_id < self.num_replicas:
            raise ValueError(
                f"policy {self.policy.name!r} chose replica {replica_id} of {self.num_replicas}"
            )
        if not self.loads.available[replica_id]:
            raise RuntimeError(f"policy {self.policy.name!r} chose replica {replica_id}, which is unavailable")
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("request %s -> replica %d (%s)", request.req_id, replica_id, self.policy.name)
        return replica_id

    def outcome(self, request: Request, replica_id: int) -> str:
        """How much of ``request``'s prompt ``replica_id`` held when it was routed there: "hit",
        every block a cache can serve (all but a last token's); "partial", some; "miss", none."""
        cacheable = num_cacheable_blocks(request.num_tokens, self.hasher.block_size)
        held = self.index.num_leading_blocks(replica_id, request.block_hashes[:cacheable])
        return "hit" if cacheable and held == cacheable else "partial" if held else "miss"

    def hash_prompt(self, request: Request) -> None:
        """Fill ``request.block_hashes`` with its prompt's full blocks' hashes, unless it has them.

        ``route`` does it; a caller with time to spare before it routes can do it first.
        """
        if not request.block_hashes:
            request.block_hashes.extend(self.hasher.hash_token_ids(request.prompt_token_ids, request.cache_salt))
