"""The routing policies by name: ``make_policy("cache_aware", cache_threshold=0.5)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvserve.scheduler.routing.cache_aware import CacheAwarePolicy
from kvserve.scheduler.routing.consistent_hash import ConsistentHashPolicy
from kvserve.scheduler.routing.cost_ttft import CostTTFTPolicy
from kvserve.scheduler.routing.least_loaded import LeastLoadedPolicy
from kvserve.scheduler.routing.policy import RoutingPolicy
from kvserve.scheduler.routing.round_robin import RoundRobinPolicy

POLICIES: dict[str, Callable[..., RoutingPolicy]] = {
    RoundRobinPolicy.name: RoundRobinPolicy,
    LeastLoadedPolicy.name: LeastLoadedPolicy,
    ConsistentHashPolicy.name: ConsistentHashPolicy,
    CacheAwarePolicy.name: CacheAwarePolicy,
    CostTTFTPolicy.name: CostTTFTPolicy,
}

DEFAULT_POLICY = CostTTFTPolicy.name


def make_policy(name: str, **kwargs: Any) -> RoutingPolicy:
    """A fresh policy by registry name; ``kwargs`` go to its constructor.

    Raises ``ValueError`` for an unknown name or an argument the policy does not take.
    """
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; choose from {sorted(POLICIES)}")
    try:
        return factory(**kwargs)
    except TypeError as exc:
        raise ValueError(f"bad arguments for routing policy {name!r}: {exc}") from None
