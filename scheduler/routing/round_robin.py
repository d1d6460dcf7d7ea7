"""Round robin: available replicas in turn, blind to caches and load (the baseline)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvserve.scheduler.routing.load import LoadTable, ReplicaLoad
from kvserve.scheduler.routing.policy import RoutingRequest
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex


class RoundRobinPolicy:
    """Request ``k`` goes to replica ``k mod n``; an unavailable replica's turn goes to the next available one."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(
        self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: GlobalPrefixIndex
    ) -> int:
        table = LoadTable.of(replicas)
        replica_id = self._next % len(table)
        if not table.all_available:
            available_ids = table.available_ids()
            position = int(np.searchsorted(available_ids, replica_id)) % len(available_ids)
            replica_id = int(available_ids[position])
        self._next = replica_id + 1
        return replica_id
