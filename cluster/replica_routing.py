"""The seam where the scheduler actor picks a replica for a new request.

A policy is a callable ``(spec, healthy_replicas) -> replica id`` chosen by
name (``ClusterConfig.routing``).  Only ``round_robin`` exists here; the
prefix-aware policies of ``kvserve.scheduler`` plug in behind the same call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kvserve.cluster.messages import RequestSpec


class RoutingPolicy(Protocol):
    def __call__(self, spec: RequestSpec, healthy_replicas: Sequence[int]) -> int:
        """Return one of ``healthy_replicas`` (never empty) for ``spec``."""
        ...


class RoundRobinPolicy:
    """Each new request goes to the next healthy replica, in turn."""

    def __init__(self) -> None:
        self._num_routed = 0

    def __call__(self, spec: RequestSpec, healthy_replicas: Sequence[int]) -> int:
        replica = healthy_replicas[self._num_routed % len(healthy_replicas)]
        self._num_routed += 1
        return replica


ROUTING_POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "round_robin": RoundRobinPolicy,
}


def make_routing_policy(name: str) -> RoutingPolicy:
    """A fresh policy by name; ``ValueError`` names the known ones otherwise."""
    try:
        factory = ROUTING_POLICIES[name]
    except KeyError:
        raise ValueError(f"routing must be one of {sorted(ROUTING_POLICIES)}, got {name!r}") from None
    return factory()
