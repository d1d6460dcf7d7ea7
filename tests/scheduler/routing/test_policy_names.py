"""Policies by name: the built-in ones, and ``module:attribute`` for one's own, imported on use."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvserve.scheduler.routing.load import ReplicaLoad
from kvserve.scheduler.routing.policies import POLICIES, make_policy, policy_factory, policy_parameters
from kvserve.scheduler.routing.policy import RoutingRequest
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex

THIS_MODULE = __name__


class LastReplicaPolicy:
    """Always the last replica: a policy of one's own, with a seed the experiment may give it."""

    name = "last_replica"

    def __init__(self, seed: int = 0, offset: int = 1) -> None:
        self.seed = seed
        self.offset = offset

    def select(self, request: RoutingRequest, replicas: Sequence[ReplicaLoad], index: GlobalPrefixIndex) -> int:
        return len(replicas) - self.offset


def last_replica(offset: int = 1) -> LastReplicaPolicy:
    return LastReplicaPolicy(offset=offset)


def not_a_policy() -> object:
    return object()


class NoSelect:
    name = "no_select"


def test_a_module_class_name_makes_that_class_without_registering_it() -> None:
    policy = make_policy(f"{THIS_MODULE}:LastReplicaPolicy", seed=3)

    assert isinstance(policy, LastReplicaPolicy) and policy.seed == 3
    assert f"{THIS_MODULE}:LastReplicaPolicy" not in POLICIES


def test_a_module_factory_name_makes_what_the_factory_returns() -> None:
    policy = make_policy(f"{THIS_MODULE}:last_replica", offset=2)

    assert isinstance(policy, LastReplicaPolicy) and policy.offset == 2


def test_the_module_is_imported_on_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What the scheduler actor does: a process that never ran the code defining the policy.
    (tmp_path / "kvserve_test_first_replica.py").write_text(
        "class FirstReplica:\n    name = 'first'\n    def select(self, request, replicas, index):\n        return 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kvserve_test_first_replica", raising=False)

    policy = make_policy("kvserve_test_first_replica:FirstReplica")

    assert policy.name == "first" and policy.select(None, [], GlobalPrefixIndex()) == 0  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name, message",
    [
        ("random", "unknown routing policy 'random': choose from cache_aware, consistent_hash, cost_ttft, "
                   "least_loaded, round_robin, or name a policy class or factory of your own as module:attribute"),
        ("kvserve_no_such_module:Policy", "routing policy 'kvserve_no_such_module:Policy': cannot import "
                                          "kvserve_no_such_module (it must be importable: installed, or on PYTHONPATH): "
                                          "ModuleNotFoundError: No module named 'kvserve_no_such_module'"),
        (f"{THIS_MODULE}:Nope", f"routing policy '{THIS_MODULE}:Nope': {THIS_MODULE} has no attribute 'Nope'"),
        (f"{THIS_MODULE}:NoSelect", f"routing policy '{THIS_MODULE}:NoSelect': NoSelect is not a RoutingPolicy: "
                                    "it has no select()"),
        (f"{THIS_MODULE}:THIS_MODULE", f"routing policy '{THIS_MODULE}:THIS_MODULE': str THIS_MODULE is not a "
                                       "policy class or factory"),
        (":LastReplicaPolicy", "routing policy ':LastReplicaPolicy': expected module:attribute"),
    ],
)
def test_a_name_that_names_no_policy_is_refused_in_one_line(name: str, message: str) -> None:
    with pytest.raises(ValueError) as error:
        policy_factory(name)

    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_factory_that_makes_no_policy_is_refused() -> None:
    with pytest.raises(ValueError, match=r"made a object, which is not a RoutingPolicy: it needs a select\(\) method"):
        make_policy(f"{THIS_MODULE}:not_a_policy")


def test_an_unknown_argument_is_refused_naming_the_arguments_and_their_defaults() -> None:
    # It said "CacheAwarePolicy.__init__() got an unexpected keyword argument 'nope'".
    with pytest.raises(ValueError) as error:
        make_policy("cache_aware", nope=1)

    assert str(error.value) == (
        "bad arguments for routing policy 'cache_aware': no parameter 'nope'; it takes balance_abs_threshold=64, "
        "balance_rel_threshold=1.5, cache_threshold=0.3"
    )


def test_an_unknown_argument_of_a_policy_without_any_says_so() -> None:
    with pytest.raises(ValueError, match="no parameter 'seed'; it takes no arguments$"):
        make_policy("round_robin", seed=1)


def test_policy_parameters_are_the_named_ones_of_the_constructor_or_factory() -> None:
    assert list(policy_parameters(f"{THIS_MODULE}:LastReplicaPolicy")) == ["seed", "offset"]
    assert list(policy_parameters(f"{THIS_MODULE}:last_replica")) == ["offset"]
    assert list(policy_parameters("round_robin")) == []
