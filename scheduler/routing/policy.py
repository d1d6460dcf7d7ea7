"""The seam between the router and its policies.

A policy sees one request (its block hashes and prompt length), every
replica's load and the global prefix index, and names a replica.  Policies
are small stateful objects (a round-robin cursor, a seeded rng) selected by
name with ``make_policy``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvserve.scheduler.block_hash import BlockHash, num_cacheable_blocks
from kvserve.scheduler.routing.load import ReplicaLoad
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex

if TYPE_CHECKING:
    from kvserve.scheduler.cost_model import StepCostModel


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What a policy knows of a request.

    ``block_hashes`` are the hashes of the prompt's full blocks (the cache
    salt is in the first, so tenants never match each other's blocks).
    """

    req_id: str
    block_hashes: Sequence[BlockHash]
    num_prompt_tokens: int
    block_size: int
    cache_salt: str | None = None
    # The most tokens it may generate (``SamplingParams.max_tokens``); None when unknown.
    max_output_tokens: int | None = None

    @property
    def max_cached_tokens(self) -> int:
        """The most prompt tokens a cache hit can cover: the last token is always computed."""
        return num_cacheable_blocks(self.num_prompt_tokens, self.block_size) * self.block_size

    def cached_tokens(self, num_matched_blocks: int) -> int:
        """Prompt tokens served from the cache by a match of ``num_matched_blocks``."""
        return min(num_matched_blocks * self.block_size, self.max_cached_tokens)


class RoutingPolicy(Protocol):
    """Chooses the replica for each request.

    ``replicas[i]`` is replica ``i``'s load (``replica_id == i``); the result
    is the id of an available replica (``replicas[i].available``).  With none
    available, ``select`` raises ``NoAvailableReplicaError``.
    """

    name: str

    def select(
        self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: GlobalPrefixIndex
    ) -> int: ...


@runtime_checkable
class FleetSettingsPolicy(Protocol):
    """A policy that prices with a step cost model and a step budget and, built without them, takes its fleet's.

    ``FleetSimulator`` calls ``adopt_fleet`` once, before the first request, so that
    ``make_policy("cost_ttft")`` prices with the simulated fleet's model and step budget; what
    was given to the constructor stays.  (A live cluster's config passes them to the constructor
    instead: ``ClusterConfig.routing_policy``.)
    """

    def adopt_fleet(self, cost_model: StepCostModel, max_num_batched_tokens: int) -> None: ...
