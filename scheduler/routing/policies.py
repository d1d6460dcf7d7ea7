"""The routing policies by name: ``make_policy("cache_aware", cache_threshold=0.5)``.

A name is a key of ``POLICIES`` (the built-in policies) or ``module:attribute``, a
class or factory of one's own, imported when first used: ``make_policy("my_policies:GreedyPrefix")``.
The second kind works in every process that can import the module (the scheduler actor
of a live cluster, an experiment's worker processes); a policy added to ``POLICIES`` at
run time exists only in the processes that ran the code adding it.
"""

from __future__ import annotations

import importlib
import inspect
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


def policy_factory(name: str) -> Callable[..., RoutingPolicy]:
    """The class or factory ``name`` names: a key of ``POLICIES``, or ``module:attribute`` (imported now).

    Raises ``ValueError`` (one line) for an unknown name, a module that cannot be imported,
    a missing attribute, or an attribute that is not a policy class or a factory.
    """
    if not isinstance(name, str):
        raise ValueError(f"a routing policy name must be a string, got {name!r}")
    factory = POLICIES.get(name)
    if factory is not None:
        return factory
    module_name, colon, attribute = name.partition(":")
    if not colon:
        raise ValueError(
            f"unknown routing policy {name!r}: choose from {', '.join(sorted(POLICIES))}, "
            "or name a policy class or factory of your own as module:attribute"
        )
    if not module_name or not attribute:
        raise ValueError(f"routing policy {name!r}: expected module:attribute, e.g. my_policies:GreedyPrefix")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001  # NOTE: the user's module may fail in any way while it runs
        hint = " (it must be importable: installed, or on PYTHONPATH)" if isinstance(exc, ImportError) else ""
        raise ValueError(
            f"routing policy {name!r}: cannot import {module_name}{hint}: {_one_line(exc)}"
        ) from exc
    found: Any = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ValueError(f"routing policy {name!r}: {module_name} has no attribute {attribute!r}")
        found = getattr(found, part)
    if isinstance(found, type):
        if not callable(getattr(found, "select", None)):
            raise ValueError(f"routing policy {name!r}: {found.__qualname__} is not a RoutingPolicy: it has no select()")
    elif not callable(found):
        raise ValueError(f"routing policy {name!r}: {type(found).__name__} {attribute} is not a policy class or factory")
    return found


def policy_parameters(name: str) -> dict[str, inspect.Parameter]:
    """The named parameters of the policy ``name``'s constructor or factory (``**kwargs`` is not one)."""
    return _named_parameters(policy_factory(name))


def describe_parameters(name: str) -> str:
    """``it takes a=1, b`` (each parameter with its default) or ``it takes no arguments``."""
    parameters = policy_parameters(name).values()
    if not parameters:
        return "it takes no arguments"
    return "it takes " + ", ".join(
        p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}" for p in parameters
    )


def make_policy(name: str, **kwargs: Any) -> RoutingPolicy:
    """A fresh policy by name (see the module's docstring); ``kwargs`` go to its constructor.

    Raises ``ValueError`` for an unknown name, an argument the policy does not take (naming
    those it takes, with their defaults), or a factory whose result is not a ``RoutingPolicy``.
    """
    factory = policy_factory(name)
    unknown = [key for key in kwargs if key not in _named_parameters(factory)]
    if unknown and not _takes_any_keyword(factory):
        names = ", ".join(repr(key) for key in unknown)
        raise ValueError(
            f"bad arguments for routing policy {name!r}: no parameter {names}; {describe_parameters(name)}"
        )
    try:
        policy = factory(**kwargs)
    except TypeError as exc:
        raise ValueError(f"bad arguments for routing policy {name!r}: {exc}") from None
    if not callable(getattr(policy, "select", None)) or not isinstance(getattr(policy, "name", None), str):
        raise ValueError(
            f"routing policy {name!r} made a {type(policy).__name__}, which is not a RoutingPolicy: "
            "it needs a select() method and a name string"
        )
    return policy


def _named_parameters(factory: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a callable whose signature Python cannot read
        return {}
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: p for p in parameters if p.kind in kinds}


def _takes_any_keyword(factory: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
