"""Consistent hashing on the prompt's first blocks, with bounded loads.

Each replica owns ``virtual_nodes`` points on a 64-bit ring.  A request's key
is its block hash number ``num_prefix_blocks - 1`` (the chain makes it a hash
of every block up to it, salt included); the request goes to the first
available replica clockwise from the key whose load is under the bound
``ceil(load_factor * (L + 1) / n)``, with ``L`` the outstanding requests of
the ``n`` available replicas (Mirrokni, Thorup, Zadimoghaddam, "Consistent
Hashing with Bounded Loads", 2018).  Requests sharing a prefix
meet on one replica until it is overloaded, then spill to the next.  The
ring holds every replica, available or not: when one fails, only its keys
move (to the next replicas clockwise), and they come back when it returns.

The default key covers the first 32 blocks (512 tokens at block size 16):
long enough to tell apart requests that share only a short system prompt,
short enough to be shared by requests that share a long one.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import xxhash

from kvserve.scheduler.checks import check_ints, check_numbers
from kvserve.scheduler.routing.load import LoadTable, ReplicaLoad
from kvserve.scheduler.routing.policy import RoutingRequest
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex


class ConsistentHashPolicy:
    """Consistent hashing with bounded loads; load is outstanding requests."""

    name = "consistent_hash"

    def __init__(
        self,
        num_prefix_blocks: int = 32,
        load_factor: float = 1.25,
        virtual_nodes: int = 64,
        seed: int = 0,
    ) -> None:
        check_ints(1, num_prefix_blocks=num_prefix_blocks, virtual_nodes=virtual_nodes)
        check_ints(0, seed=seed)
        check_numbers(1, above=True, load_factor=load_factor)
        self.num_prefix_blocks = num_prefix_blocks
        self.load_factor = load_factor
        self.virtual_nodes = virtual_nodes
        self.seed = seed
        self._num_replicas = 0
        self._points: list[int] = []
        self._owners: list[int] = []

    def _build_ring(self, num_replicas: int) -> None:
        ring = sorted(
            (xxhash.xxh3_64_intdigest(f"{self.seed}/{replica}/{v}".encode()), replica)
            for replica in range(num_replicas)
            for v in range(self.virtual_nodes)
        )
        self._points = [point for point, _ in ring]
        self._owners = [owner for _, owner in ring]
        self._num_replicas = num_replicas

    def key(self, request: RoutingRequest) -> int:
        """The ring position of ``request``: its prefix hash, or its id when shorter than a block."""
        hashes = request.block_hashes
        if hashes:
            return int.from_bytes(hashes[min(self.num_prefix_blocks, len(hashes)) - 1][:8], "little")
        return xxhash.xxh3_64_intdigest(request.req_id.encode())

    def select(
        self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: GlobalPrefixIndex
    ) -> int:
        table = LoadTable.of(replicas)
        num_replicas = len(table)
        if num_replicas != self._num_replicas:
            self._build_ring(num_replicas)
        table.check_any_available()
        bound = math.ceil(table.bounded_load(self.load_factor))
        outstanding = table.num_outstanding
        available = table.available
        points, owners = self._points, self._owners
        start = bisect.bisect_left(points, self.key(request))
        num_points = len(points)
        for step in range(num_points):
            owner = owners[(start + step) % num_points]
            if available[owner] and outstanding[owner] < bound:
                return owner
        # Unreachable: the bound times the available replicas exceeds their load,
        # so an available replica is under it.
        raise RuntimeError(f"no available replica under the load bound {bound}")
