"""Unavailable replicas (failed, or not started yet) are never chosen, and a failed one's cache is forgotten."""

from __future__ import annotations

import pytest

from kvserve.scheduler.block_hash import BlockHasher
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.request import Request
from kvserve.scheduler.routing.cache_aware import CacheAwarePolicy
from kvserve.scheduler.routing.consistent_hash import ConsistentHashPolicy
from kvserve.scheduler.routing.cost_ttft import CostTTFTPolicy
from kvserve.scheduler.routing.least_loaded import LeastLoadedPolicy
from kvserve.scheduler.routing.load import LoadTable, NoAvailableReplicaError, ReplicaLoad
from kvserve.scheduler.routing.policies import POLICIES, make_policy
from kvserve.scheduler.routing.policy import RoutingRequest
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex
from kvserve.scheduler.routing.round_robin import RoundRobinPolicy
from kvserve.scheduler.routing.router import Router
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.cost_model import StepCostModel

BLOCK_SIZE = 16
HASHER = BlockHasher(BLOCK_SIZE)
MODEL = StepCostModel(a=0.01, b=1e-4, c=1e-4, d=0.0)
# The fleets of real schedulers use small blocks.
FLEET_BLOCK_SIZE = 4
FLEET_HASHER = BlockHasher(FLEET_BLOCK_SIZE, "m")


def request(prompt_len: int = 160, seed: int = 0) -> RoutingRequest:
    prompt = [(seed * 7919 + i) % 30_000 + 3 for i in range(prompt_len)]
    return RoutingRequest(f"r{seed}", HASHER.hash_token_ids(prompt), prompt_len, BLOCK_SIZE)


def loads(outstanding: list[int], unavailable: set[int]) -> list[ReplicaLoad]:
    return [
        ReplicaLoad(r, num_running=n, num_free_blocks=1000, num_total_blocks=1000, available=r not in unavailable)
        for r, n in enumerate(outstanding)
    ]


def index_caching(replica_ids: list[int], requests: list[RoutingRequest]) -> GlobalPrefixIndex:
    """An index where each of ``replica_ids`` caches every block of every request."""
    index = GlobalPrefixIndex()
    for replica_id in replica_ids:
        for req in requests:
            index.add_blocks(replica_id, list(req.block_hashes))
    return index


# -- every policy ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_policy_chooses_an_unavailable_replica_even_the_idle_one_caching_every_prompt(name: str) -> None:
    # Replicas 1 and 3 are idle and cache every prompt: the best choice by far, were they up.
    policy = make_policy(name)
    requests = [request(seed=k) for k in range(60)]
    index = index_caching([1, 3], requests)
    table = LoadTable.of(loads([5, 0, 7, 0], unavailable={1, 3}))

    choices = {policy.select(req, table, index) for req in requests}

    assert choices <= {0, 2}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_raises_when_no_replica_is_available(name: str) -> None:
    with pytest.raises(NoAvailableReplicaError, match="none of the 3 replicas"):
        make_policy(name).select(request(), loads([0, 0, 0], unavailable={0, 1, 2}), GlobalPrefixIndex())


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_uses_the_only_available_replica(name: str) -> None:
    choices = {
        make_policy(name).select(request(seed=k), loads([0, 9, 0], unavailable={0, 2}), GlobalPrefixIndex())
        for k in range(10)
    }

    assert choices == {1}


# -- each policy's way of skipping ----------------------------------------------------


def test_round_robin_gives_an_unavailable_replicas_turn_to_the_next_available() -> None:
    policy = RoundRobinPolicy()
    table = LoadTable.of(loads([0, 0, 0, 0], unavailable={1}))

    choices = [policy.select(request(), table, GlobalPrefixIndex()) for _ in range(6)]

    assert choices == [0, 2, 3, 0, 2, 3]


def test_least_loaded_samples_among_the_available_replicas_only() -> None:
    policy = LeastLoadedPolicy(seed=0)
    table = LoadTable.of(loads([0] * 6, unavailable={0, 2, 3, 5}))

    choices = {policy.select(request(), table, GlobalPrefixIndex()) for _ in range(50)}

    assert choices == {1, 4}


def test_consistent_hash_moves_only_the_keys_of_an_unavailable_replica_and_they_come_back() -> None:
    policy = ConsistentHashPolicy()
    requests = [request(seed=k) for k in range(200)]
    index = GlobalPrefixIndex()
    table = LoadTable.of(loads([0] * 8, unavailable=set()))
    homes = [policy.select(req, table, index) for req in requests]

    table.set_available(3, False)
    moved = [policy.select(req, table, index) for req in requests]
    table.set_available(3, True)
    back = [policy.select(req, table, index) for req in requests]

    assert 3 in homes and 3 not in moved
    assert all(now == home for home, now in zip(homes, moved) if home != 3)
    assert back == homes


def test_cache_aware_ignores_the_match_of_an_unavailable_replica() -> None:
    req = request()
    index = GlobalPrefixIndex()
    index.add_blocks(0, list(req.block_hashes))  # all 10 blocks, on the unavailable replica
    index.add_blocks(2, list(req.block_hashes[:8]))

    choice = CacheAwarePolicy().select(req, loads([0, 0, 3], unavailable={0}), index)

    assert choice == 2


def test_cache_aware_balances_among_the_available_replicas_only() -> None:
    req = request()
    index = index_caching([2], [req])
    # Available: 100 and 30 outstanding (imbalanced); the idle replica 1 is down.
    table = loads([100, 0, 100, 30], unavailable={1})

    assert CacheAwarePolicy().select(req, table, index) == 3
    # Balanced among the available (90 - 40 <= 64), though not counting the idle one that is down,
    # nor the busy one that is down (200 - 30 > 64 and 200 > 1.5 x 30).
    assert CacheAwarePolicy().select(req, loads([90, 0, 60, 40], unavailable={1}), index) == 2
    assert CacheAwarePolicy().select(req, loads([50, 200, 60, 30], unavailable={1}), index) == 2


def test_cost_ttft_skips_the_unavailable_replica_with_the_lowest_estimate() -> None:
    req = request(prompt_len=1600)
    index = index_caching([0], [req])
    policy = CostTTFTPolicy(MODEL)

    assert policy.select(req, loads([0, 2, 1], unavailable=set()), index) == 0
    assert policy.select(req, loads([0, 2, 1], unavailable={0}), index) == 2


def test_cost_ttft_bounded_loads_count_only_the_available_replicas() -> None:
    # 1 of 4 replicas up with 3 requests: a bound over 4 replicas, ceil(1.25 * 4 / 4) = 2,
    # would exclude it; over the one available replica it cannot.
    table = loads([3, 0, 0, 0], unavailable={1, 2, 3})

    assert CostTTFTPolicy(MODEL, load_factor=1.25, load_slack=0).select(request(), table, GlobalPrefixIndex()) == 0


def test_bounded_loads_ignore_the_requests_of_an_unavailable_replica() -> None:
    # A draining replica's 200 requests cannot move: they must not raise the others' bound.
    req = request(prompt_len=1600)
    policy = ConsistentHashPolicy(load_factor=1.25)
    home = policy.select(req, loads([0, 0, 0, 0], unavailable=set()), GlobalPrefixIndex())
    draining = (home + 1) % 4
    outstanding = [0, 0, 0, 0]
    outstanding[home], outstanding[draining] = 5, 200
    table = loads(outstanding, unavailable={draining})

    # ceil(1.25 * (5 + 1) / 3) = 3: the home replica is over it (over all four, 86 is not).
    assert policy.select(req, table, GlobalPrefixIndex()) not in (home, draining)
    cost = CostTTFTPolicy(MODEL, load_factor=1.25, load_slack=0)
    assert cost.select(req, table, index_caching([home], [req])) not in (home, draining)
    assert cost.select(req, loads(outstanding, unavailable=set()), index_caching([home], [req])) == home


# -- the load table and the router ------------------------------------------------------


def test_load_table_counts_available_replicas_and_keeps_their_loads() -> None:
    table = LoadTable.of(loads([1, 2, 3], unavailable={1}))

    assert table.num_available == 2 and not table.all_available
    assert list(table.available_ids()) == [0, 2]
    assert table[1] == ReplicaLoad(1, num_running=2, num_free_blocks=1000, num_total_blocks=1000, available=False)
    table.set_available(1, True)
    table.set_available(1, True)
    assert table.num_available == 3 and table.all_available
    assert table.available_outstanding == 6
    table.set_available(2, False)
    table.set(2, ReplicaLoad(2, num_running=10))
    table.set(0, ReplicaLoad(0, num_waiting=4))
    assert table.available_outstanding == 6  # replica 2's requests no longer count; replica 0's do
    table.set_available(2, True)
    assert table.available_outstanding == 16


def fleet(policy: str, num_replicas: int = 3) -> tuple[Router, list[Scheduler]]:
    router = Router(num_replicas, make_policy(policy), FLEET_BLOCK_SIZE, model_id="m")
    schedulers = [
        Scheduler(
            SchedulerConfig(max_num_batched_tokens=256, max_model_len=256),
            CacheConfig(block_size=FLEET_BLOCK_SIZE, num_blocks=64, model_id="m"),
            observer=router.observer_for(r),
        )
        for r in range(num_replicas)
    ]
    for replica_id, scheduler in enumerate(schedulers):
        router.update_load(replica_id, scheduler.get_load())
    return router, schedulers


def serve(router: Router, schedulers: list[Scheduler], request: Request) -> int:
    replica_id = router.route(request)
    scheduler = schedulers[replica_id]
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        router.update_load(replica_id, scheduler.get_load())
        scheduler.update(plan, [5] * plan.num_sampled)
    router.update_load(replica_id, scheduler.get_load())
    return replica_id


def test_router_raises_when_no_replica_is_available() -> None:
    router, _ = fleet("cost_ttft", num_replicas=2)
    router.set_available(0, False)
    router.set_available(1, False)

    with pytest.raises(NoAvailableReplicaError):
        router.route(Request("a", [1, 2, 3], SamplingParams()))
    with pytest.raises(ValueError, match="replica_id"):
        router.set_available(2, True)


def test_a_failed_replica_leaves_the_index_and_its_prompts_go_elsewhere_uncached() -> None:
    router, schedulers = fleet("cache_aware")
    prompt = list(range(3, 43))
    home = serve(router, schedulers, Request("a", prompt, SamplingParams(max_tokens=2)))
    hashes = FLEET_HASHER.hash_token_ids(prompt)
    assert router.index.match(hashes) == {home: 10}

    # The replica fails: its pool (no request left) resets its prefix cache, its KV is gone.
    assert schedulers[home].kv_cache_manager.reset_prefix_cache()
    router.set_available(home, False)

    assert router.index.match(hashes) == {}
    assert router.index.num_blocks(home) == 0
    again = Request("b", prompt, SamplingParams(max_tokens=2))
    assert serve(router, schedulers, again) != home
    assert again.num_cached_tokens == 0


def test_a_replica_back_after_failing_is_chosen_again_with_a_consistent_index() -> None:
    router, schedulers = fleet("round_robin", num_replicas=2)
    serve(router, schedulers, Request("a", list(range(3, 43)), SamplingParams(max_tokens=2)))  # replica 0
    assert schedulers[0].kv_cache_manager.reset_prefix_cache()
    router.set_available(0, False)
    assert serve(router, schedulers, Request("b", list(range(50, 90)), SamplingParams(max_tokens=2))) == 1

    router.set_available(0, True)
    replicas = [
        serve(router, schedulers, Request(f"c{k}", list(range(3, 43)), SamplingParams(max_tokens=2))) for k in range(2)
    ]

    assert replicas == [0, 1]
    assert router.index.match(FLEET_HASHER.hash_token_ids(list(range(3, 43)))) == {0: 10, 1: 10}

