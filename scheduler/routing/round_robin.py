"""Round robin: replicas in turn, blind to caches and load (the baseline)."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.scheduler.routing.load import ReplicaLoad
from kvserve.scheduler.routing.policy import RoutingRequest
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex


class RoundRobinPolicy:
    """Request ``k`` goes to replica ``k mod n``."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(
        self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: GlobalPrefixIndex
    ) -> int:
        replica_id = self._next % len(replicas)
        self._next = replica_id + 1
        return replica_id
