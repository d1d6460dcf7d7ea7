"""Each routing policy's choice in hand-made situations."""

from __future__ import annotations

import pytest

from kvserve.scheduler.block_hash import BlockHasher
from kvserve.scheduler.routing.cache_aware import CacheAwarePolicy
from kvserve.scheduler.routing.consistent_hash import ConsistentHashPolicy
from kvserve.scheduler.routing.least_loaded import LeastLoadedPolicy
from kvserve.scheduler.routing.load import LoadTable, ReplicaLoad
from kvserve.scheduler.routing.policies import POLICIES, make_policy
from kvserve.scheduler.routing.policy import RoutingRequest
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex
from kvserve.scheduler.routing.round_robin import RoundRobinPolicy

BLOCK_SIZE = 16
HASHER = BlockHasher(BLOCK_SIZE)


def request(prompt_len: int = 160, seed: int = 0, req_id: str = "r") -> RoutingRequest:
    prompt = [(seed * 7919 + i) % 30_000 + 3 for i in range(prompt_len)]
    return RoutingRequest(req_id, HASHER.hash_token_ids(prompt), prompt_len, BLOCK_SIZE)


def idle(num_replicas: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(r, num_free_blocks=1000, num_total_blocks=1000) for r in range(num_replicas)]


def with_outstanding(counts: list[int]) -> list[ReplicaLoad]:
    return [ReplicaLoad(r, num_running=n, num_free_blocks=1000, num_total_blocks=1000) for r, n in enumerate(counts)]


def index_with(replica_blocks: dict[int, int], req: RoutingRequest) -> GlobalPrefixIndex:
    """An index where replica r caches the first ``replica_blocks[r]`` blocks of ``req``."""
    index = GlobalPrefixIndex()
    for replica_id, num_blocks in replica_blocks.items():
        index.add_blocks(replica_id, list(req.block_hashes[:num_blocks]))
    return index


# -- round robin and least loaded ------------------------------------------------------


def test_round_robin_cycles_through_replicas() -> None:
    policy = RoundRobinPolicy()
    choices = [policy.select(request(), idle(3), GlobalPrefixIndex()) for _ in range(7)]

    assert choices == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_picks_the_less_loaded_of_two() -> None:
    policy = LeastLoadedPolicy(seed=1)

    choices = {policy.select(request(), with_outstanding([5, 0]), GlobalPrefixIndex()) for _ in range(20)}

    assert choices == {1}


def test_least_loaded_never_picks_the_most_loaded_of_three() -> None:
    policy = LeastLoadedPolicy(seed=3)
    loads = with_outstanding([4, 9, 2])

    choices = [policy.select(request(), loads, GlobalPrefixIndex()) for _ in range(50)]

    assert 1 not in choices and set(choices) == {0, 2}


def test_least_loaded_breaks_a_tie_of_requests_by_queued_prefill_tokens() -> None:
    loads = [ReplicaLoad(r, num_waiting=2, num_queued_prefill_tokens=q) for r, q in enumerate([500, 100])]
    policy = LeastLoadedPolicy(seed=0)

    assert {policy.select(request(), loads, GlobalPrefixIndex()) for _ in range(20)} == {1}


def test_least_loaded_is_deterministic_for_a_seed() -> None:
    loads = with_outstanding([1, 1, 1, 1, 1, 1])

    def choices(seed: int) -> list[int]:
        policy = LeastLoadedPolicy(seed)
        return [policy.select(request(), loads, GlobalPrefixIndex()) for _ in range(30)]

    assert choices(7) == choices(7)
    assert choices(7) != choices(8)


# -- consistent hashing with bounded loads ------------------------------------------------


def test_consistent_hash_sends_a_shared_prefix_to_one_replica() -> None:
    policy = ConsistentHashPolicy(num_prefix_blocks=4)
    shared = [3 + i for i in range(64)]  # 4 blocks shared, different tails
    requests = [
        RoutingRequest(f"r{k}", HASHER.hash_token_ids(shared + [100 + k] * 32), 96, BLOCK_SIZE) for k in range(10)
    ]

    choices = {policy.select(r, idle(16), GlobalPrefixIndex()) for r in requests}

    assert len(choices) == 1


def test_consistent_hash_spreads_different_prefixes() -> None:
    policy = ConsistentHashPolicy()

    choices = {policy.select(request(seed=k), idle(8), GlobalPrefixIndex()) for k in range(200)}

    assert choices == set(range(8))


def test_consistent_hash_skips_a_replica_over_the_load_bound() -> None:
    policy = ConsistentHashPolicy(load_factor=1.25)
    req = request()
    home = policy.select(req, idle(4), GlobalPrefixIndex())
    counts = [2, 2, 2, 2]
    counts[home] = 4  # bound = ceil(1.25 * (10 + 1) / 4) = 4: home is full

    choice = policy.select(req, with_outstanding(counts), GlobalPrefixIndex())

    assert choice != home
    # It spills to the next replica clockwise, not to the least loaded: that one, with the home
    # replica down, is where the request would go anyway (and stays under the bound).
    table = LoadTable.of(idle(4))
    table.set_available(home, False)
    assert choice == policy.select(req, table, GlobalPrefixIndex())
    counts = [0, 0, 0, 0]
    counts[home], counts[choice] = 4, 1  # bound = ceil(1.25 * 6 / 4) = 2: the next one is still under it
    assert policy.select(req, with_outstanding(counts), GlobalPrefixIndex()) == choice


def test_consistent_hash_keys_on_the_whole_prefix_not_the_first_block() -> None:
    policy = ConsistentHashPolicy(num_prefix_blocks=4)
    shared = [3 + i for i in range(16)]  # only the first block is shared
    requests = [
        RoutingRequest(f"r{k}", HASHER.hash_token_ids(shared + [100 + k] * 48), 64, BLOCK_SIZE) for k in range(200)
    ]

    assert len({policy.select(r, idle(8), GlobalPrefixIndex()) for r in requests}) == 8  # keyed on block 0: 1


# -- SGLang's cache-aware thresholds -------------------------------------------------------


def test_cache_aware_follows_the_longest_match_when_balanced() -> None:
    req = request(prompt_len=160)  # 10 blocks
    index = index_with({0: 2, 2: 8}, req)

    assert CacheAwarePolicy().select(req, with_outstanding([0, 0, 30]), index) == 2


def test_cache_aware_ignores_a_match_below_the_cache_threshold() -> None:
    req = request(prompt_len=160)
    index = index_with({2: 4}, req)  # 64 / 160 = 0.4 < 0.5

    assert CacheAwarePolicy(cache_threshold=0.5).select(req, with_outstanding([3, 1, 2]), index) == 1
    assert CacheAwarePolicy(cache_threshold=0.3).select(req, with_outstanding([3, 1, 2]), index) == 2


def test_cache_aware_balances_when_both_thresholds_are_exceeded() -> None:
    req = request()
    index = index_with({0: 10}, req)

    # max - min = 70 > 64 and 100 > 1.5 x 30: imbalanced, so the least loaded wins.
    assert CacheAwarePolicy().select(req, with_outstanding([100, 30, 40]), index) == 1
    # max - min = 70 but 100 < 1.5 x 70: only the absolute threshold, so the match wins.
    assert CacheAwarePolicy().select(req, with_outstanding([100, 70, 80]), index) == 0
    # 20 > 1.5 x 1 but max - min = 19 < 64: only the relative one.
    assert CacheAwarePolicy().select(req, with_outstanding([20, 1, 5]), index) == 0


def test_cache_aware_balances_only_when_both_thresholds_are_strictly_exceeded() -> None:
    req = request()
    index = index_with({0: 10}, req)
    policy = CacheAwarePolicy()

    assert policy.select(req, with_outstanding([94, 30, 40]), index) == 0  # max - min = 64: not over
    assert policy.select(req, with_outstanding([95, 30, 40]), index) == 1
    assert policy.select(req, with_outstanding([195, 130, 140]), index) == 0  # max = 1.5 x min: not over
    assert policy.select(req, with_outstanding([196, 130, 140]), index) == 1


def test_cache_aware_follows_a_match_of_exactly_the_cache_threshold() -> None:
    req = request(prompt_len=160)
    loads = with_outstanding([3, 0, 2])

    assert CacheAwarePolicy(cache_threshold=0.3).select(req, loads, index_with({2: 3}, req)) == 2  # 48 / 160
    assert CacheAwarePolicy(cache_threshold=0.3).select(req, loads, index_with({2: 2}, req)) == 1  # 32 / 160
    # 0.07 x 1600 is 112.00000000000001 in floating point: exactly 7% still counts.
    long = request(prompt_len=1600)
    assert CacheAwarePolicy(cache_threshold=0.07).select(long, loads, index_with({2: 7}, long)) == 2  # 112 / 1600


def test_cache_aware_counts_only_the_tokens_a_match_saves() -> None:
    # A one-block prompt cached whole saves nothing: its last token is computed, so its block is.
    req = request(prompt_len=16)

    assert CacheAwarePolicy().select(req, with_outstanding([3, 0]), index_with({0: 1}, req)) == 1


def test_cache_aware_sends_equal_matches_to_the_less_loaded_holder() -> None:
    req = request(prompt_len=160)
    index = index_with({0: 8, 2: 8}, req)

    assert CacheAwarePolicy().select(req, with_outstanding([5, 0, 1]), index) == 2
    assert CacheAwarePolicy().select(req, with_outstanding([1, 0, 5]), index) == 0


def test_cache_aware_without_any_match_goes_to_the_least_loaded() -> None:
    assert CacheAwarePolicy().select(request(), with_outstanding([2, 1, 0, 3]), GlobalPrefixIndex()) == 2


# -- registry and load table ---------------------------------------------------------------


def test_make_policy_builds_every_registered_policy_by_name() -> None:
    for name in POLICIES:
        policy = make_policy(name)
        assert policy.name == name
        assert 0 <= policy.select(request(), idle(3), GlobalPrefixIndex()) < 3


def test_make_policy_rejects_unknown_names_and_arguments() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
    with pytest.raises(ValueError, match="bad arguments"):
        make_policy("round_robin", seed=3)


@pytest.mark.parametrize(
    ("name", "argument", "value"),
    [
        ("cost_ttft", "load_factor", float("inf")),
        ("cost_ttft", "load_factor", 1.0),
        ("cost_ttft", "tie_tolerance_steps", float("nan")),
        ("cost_ttft", "max_num_batched_tokens", 2.5),
        ("cost_ttft", "load_slack", True),
        ("cost_ttft", "cost_model", 1),
        ("cost_ttft", "load_slack", -1),
        ("least_loaded", "seed", "x"),
        ("least_loaded", "seed", -1),
        ("consistent_hash", "seed", 2.5),
        ("consistent_hash", "num_prefix_blocks", 1.5),
        ("consistent_hash", "virtual_nodes", 2.5),
        ("consistent_hash", "load_factor", float("nan")),
        ("cache_aware", "balance_abs_threshold", float("nan")),
        ("cache_aware", "balance_rel_threshold", float("nan")),
        ("cache_aware", "balance_rel_threshold", 0.5),
        ("cache_aware", "cache_threshold", 1.5),
        ("cache_aware", "cache_threshold", "0.3"),
    ],
)
def test_a_bad_policy_argument_fails_when_given_not_at_the_first_request(name: str, argument: str, value: object) -> None:
    with pytest.raises(ValueError, match=argument):
        make_policy(name, **{argument: value})


def test_load_table_requires_replica_ids_in_order() -> None:
    with pytest.raises(ValueError, match="ids must be 0..n-1"):
        LoadTable.of([ReplicaLoad(1), ReplicaLoad(0)])


def test_load_table_keeps_the_outstanding_requests_of_the_available_replicas() -> None:
    table = LoadTable.of(with_outstanding([1, 2, 3]))
    table.set(1, ReplicaLoad(1, num_running=5, num_waiting=5))

    assert table.available_outstanding == 14
    assert table[1] == ReplicaLoad(1, num_running=5, num_waiting=5)
    assert list(table.num_outstanding) == [1, 10, 3]
