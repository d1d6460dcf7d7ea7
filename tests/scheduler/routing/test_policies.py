"""Each routing policy's choice in hand-made situations."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import pytest

from kvserve.scheduler.block_hash import BlockHasher
from kvserve.scheduler.routing.cache_aware import CacheAwarePolicy
from kvserve.scheduler.routing.consistent_hash import ConsistentHashPolicy
from kvserve.scheduler.routing.cost_ttft import CostTTFTPolicy
from kvserve.scheduler.routing.least_loaded import LeastLoadedPolicy
from kvserve.scheduler.routing.load import LoadTable, ReplicaLoad
from kvserve.scheduler.routing.policies import POLICIES, make_policy
from kvserve.scheduler.routing.policy import RoutingRequest
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex
from kvserve.scheduler.routing.round_robin import RoundRobinPolicy
from kvserve.scheduler.simulation.cost_model import StepCostModel

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


def served_other_prompts(index: GlobalPrefixIndex, *replica_ids: int) -> GlobalPrefixIndex:
    """``index`` with each of ``replica_ids`` caching a block of an unrelated prompt, as replicas of a
    running fleet do: none is an empty replica, which would take a copy of a shared prefix."""
    for replica_id in replica_ids:
        index.add_blocks(replica_id, list(request(prompt_len=16, seed=1000 + replica_id).block_hashes))
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


# -- cost-based: estimated time to first token ------------------------------------------------

MODEL = StepCostModel(a=0.01, b=1e-4, c=1e-4, d=0.0)


def test_cost_ttft_prefers_the_replica_that_caches_the_prompt() -> None:
    req = request(prompt_len=1600)
    index = index_with({3: 90}, req)

    assert CostTTFTPolicy(MODEL).select(req, idle(4), index) == 3


def test_cost_ttft_leaves_a_cached_replica_whose_queue_costs_more_than_the_miss() -> None:
    req = request(prompt_len=1600)
    index = index_with({0: 99}, req)
    loads = idle(2)
    loads[0] = ReplicaLoad(0, num_running=1, num_waiting=4, num_queued_prefill_tokens=8000,
                           num_free_blocks=1000, num_total_blocks=1000)

    assert CostTTFTPolicy(MODEL).select(req, loads, index) == 1


def test_cost_ttft_estimate_prices_steps_and_prefill_tokens() -> None:
    req = request(prompt_len=1000)  # 62 full blocks; at most 992 tokens can hit
    index = index_with({1: 62}, req)
    loads = [
        ReplicaLoad(0, num_running=48, num_queued_prefill_tokens=3000, num_running_tokens=10_000,
                    num_inflight_prefill_tokens=1000),
        ReplicaLoad(1, num_running=0, num_queued_prefill_tokens=0),
    ]
    policy = CostTTFTPolicy(StepCostModel(a=0.01, b=1e-4, c=1e-3, d=1e-6), max_num_batched_tokens=2048)

    ttft = policy.estimate_ttft(req, loads, index)

    # Replica 0: half the step in flight (0.01 + 0.048 + 0.01 s, and 1000 prefill tokens), then
    # 4000 tokens of work in ceil(4000 / 2000) = 2 steps of 0.01 + 0.048 + 0.01 s.
    assert ttft[0] == pytest.approx(0.5 * (0.068 + 1000e-4) + 2 * (0.01 + 48e-3 + 10_000e-6) + 4000e-4)
    # Replica 1: 8 uncached tokens in one step.
    assert ttft[1] == pytest.approx(0.01 + 8e-4)


def test_cost_ttft_estimate_leaves_a_prefill_budget_less_one_token_per_running_decode() -> None:
    req = request(prompt_len=1000)
    index = index_with({1: 62}, req)
    model = StepCostModel(a=0.01, b=1e-4, c=0.0, d=0.0)
    loads = [
        # 2000 queued tokens of which 1000 were cached when queued, plus 1000 uncached of its own:
        # 2000 tokens of work; with 49 decodes running, 1999 per step: 2 steps (2048 would take 1).
        ReplicaLoad(0, num_running=49, num_queued_prefill_tokens=2000, num_queued_cached_tokens=1000),
        # The whole prompt's 62 blocks are cached, but the last token is computed: 8 tokens.
        ReplicaLoad(1),
    ]

    ttft = CostTTFTPolicy(model, max_num_batched_tokens=2048).estimate_ttft(req, loads, index)

    assert ttft[0] == pytest.approx(0.5 * 0.01 + 2 * 0.01 + 2000e-4)  # half the step in flight, then 2 steps
    assert ttft[1] == pytest.approx(0.01 + 8e-4)
    whole = request(prompt_len=992)  # exactly 62 blocks: the last one is recomputed
    assert CostTTFTPolicy(model).estimate_ttft(whole, [ReplicaLoad(0)], index_with({0: 62}, whole))[0] == (
        pytest.approx(0.01 + 16e-4)
    )


def test_cost_ttft_breaks_ties_by_fewest_outstanding_requests() -> None:
    # Equal estimates (no queued prefill, no running decodes) but different waiting counts.
    loads = [ReplicaLoad(r, num_waiting=w) for r, w in enumerate([2, 1, 0, 1])]

    assert CostTTFTPolicy(MODEL).select(request(), loads, GlobalPrefixIndex()) == 2


def test_cost_ttft_sends_a_new_prompt_where_fewest_new_prompts_went_lately() -> None:
    # Equal estimates; replica 1 has one more request outstanding.  Prompt A, which
    # no replica holds, takes the fewest outstanding (0); prompt B then goes to
    # replica 1, where no new prompt went yet, despite its extra request.
    loads = [ReplicaLoad(0), ReplicaLoad(1, num_waiting=1)]
    index = GlobalPrefixIndex()
    policy = CostTTFTPolicy(MODEL)

    assert policy.select(request(seed=1, req_id="a"), loads, index) == 0
    assert policy.select(request(seed=2, req_id="b"), loads, index) == 1

    # Without the rule, both go to the fewest outstanding.
    by_outstanding = CostTTFTPolicy(MODEL, home_window=None)
    assert by_outstanding.select(request(seed=1, req_id="a"), loads, index) == 0
    assert by_outstanding.select(request(seed=2, req_id="b"), loads, index) == 0


def test_cost_ttft_counts_only_new_prompts_among_the_placements_that_steer_new_prompts() -> None:
    # Prompt A, new, takes replica 0 (fewest outstanding); prompt C, held by replica 1,
    # goes there on its match.  C is no new prompt, so only A counts: the next new
    # prompt goes to replica 1 despite its extra request.
    loads = [ReplicaLoad(0), ReplicaLoad(1, num_waiting=1)]
    held = request(prompt_len=1600, seed=3, req_id="c")
    index = index_with({1: 90}, held)
    policy = CostTTFTPolicy(MODEL)

    assert policy.select(request(seed=1, req_id="a"), loads, index) == 0
    assert policy.select(held, loads, index) == 1
    assert policy.select(request(seed=2, req_id="b"), loads, index) == 1


def test_cost_ttft_breaks_ties_of_a_prompt_some_replica_holds_by_outstanding_requests_alone() -> None:
    # Replica 2 holds a fifth of prompt C but is busy enough to be out of the tie:
    # C is not a new prompt, so the placements of new prompts do not steer it.
    req = request(prompt_len=800, seed=3, req_id="c")
    index = index_with({2: 10}, req)
    loads = [ReplicaLoad(0), ReplicaLoad(1, num_waiting=1),
             ReplicaLoad(2, num_waiting=9, num_queued_prefill_tokens=9000)]
    policy = CostTTFTPolicy(MODEL)
    assert policy.select(request(seed=1, req_id="a"), loads, GlobalPrefixIndex()) == 0  # a new prompt on 0

    assert policy.select(req, loads, index) == 0


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
        ("cost_ttft", "work_penalty", float("inf")),
        ("cost_ttft", "tie_tolerance_steps", float("nan")),
        ("cost_ttft", "max_num_batched_tokens", 2.5),
        ("cost_ttft", "load_slack", True),
        ("cost_ttft", "share_deviations", float("inf")),
        ("cost_ttft", "cost_model", 1),
        ("cost_ttft", "match_pending", "yes"),
        ("cost_ttft", "spread_tolerance_steps", float("nan")),
        ("cost_ttft", "home_window", 0),
        ("cost_ttft", "shared_match_window", 0),
        ("cost_ttft", "shared_match_window", 1.5),
        ("cost_ttft", "private_copy_charge", -1.0),
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


def saw_sessions_fork(policy: CostTTFTPolicy, req: RoutingRequest) -> None:
    """Make ``policy`` have seen earlier sessions go on from every block of ``req``'s prompt but its last:
    a match of its system prompt is then shared, as every new session's is in a running fleet."""
    policy.shared_matches.observe(req.block_hashes, 0)


def forked_policy(
    req: RoutingRequest, model: StepCostModel, routed: Sequence[int] = (), num_replicas: int = 1, **kwargs: object
) -> CostTTFTPolicy:
    """A cost_ttft policy that saw sessions fork on ``req``'s prompt (``saw_sessions_fork``) and routed
    the requests ``routed`` (replica ids) among ``num_replicas``."""
    policy = CostTTFTPolicy(model, **kwargs)
    saw_sessions_fork(policy, req)
    for replica_id in routed:
        policy.recent_share.record(replica_id, num_replicas)
    return policy


def test_cost_ttft_sends_a_new_session_to_an_idle_replica_over_a_busy_one_holding_only_a_system_prompt() -> None:
    """The system prompt saves less than a step: a near-tie, so the less loaded replica wins."""
    req = request(prompt_len=384)
    index = served_other_prompts(index_with({0: 16}, req), 1)  # replica 0 caches the 256-token system prompt
    loads = [
        ReplicaLoad(0, num_running=30, num_running_tokens=60_000, num_free_blocks=1000, num_total_blocks=1000),
        ReplicaLoad(1, num_free_blocks=1000, num_total_blocks=1000),
    ]
    policy = CostTTFTPolicy(StepCostModel.default())
    saw_sessions_fork(policy, req)

    assert policy.estimate_ttft(req, loads, index)[0] < policy.estimate_ttft(req, loads, index)[1]
    assert policy.select(req, loads, index) == 1
    ttft_only = CostTTFTPolicy(StepCostModel.default(), tie_tolerance_steps=0, decode_horizon=0)
    saw_sessions_fork(ttft_only, req)
    assert ttft_only.select(req, loads, index) == 0


def test_cost_ttft_sends_a_new_session_to_a_replica_far_under_its_share_within_two_steps() -> None:
    """A busy replica holding the system prompt saves a new session 8 ms over an idle one that does
    not (more than a tie); once the idle replica is far under its share, it takes the session."""
    model = StepCostModel.default()
    first_turn = request(prompt_len=384)
    index = served_other_prompts(index_with({0: 16}, first_turn), 1)  # replica 0 caches the system prompt
    loads = [
        ReplicaLoad(0, num_running=10, num_running_tokens=6000, num_free_blocks=1000, num_total_blocks=1000),
        ReplicaLoad(1, num_free_blocks=1000, num_total_blocks=1000),
    ]

    policy_after = functools.partial(forked_policy, first_turn, model, num_replicas=2)

    estimate = policy_after([]).estimate_ttft(first_turn, loads, index)
    step = model.a + 10 * model.c + 6000 * model.d
    assert 0.5 * step < estimate[1] - estimate[0] < 2 * step
    # Balanced so far, or not far enough from it at start-up: the estimate decides.
    assert policy_after([0, 1] * 100).select(first_turn, loads, index) == 0
    assert policy_after([0] * 16).select(first_turn, loads, index) == 0  # mean 8: 3 deviations exceed it
    # 200 requests all on replica 0: replica 1's count is under the mean (~95) less half of it.
    assert policy_after([0] * 200).select(first_turn, loads, index) == 1
    assert policy_after([0] * 200, spread_tolerance_steps=0).select(first_turn, loads, index) == 0
    assert policy_after([0] * 200, spread_tolerance_steps=1).select(first_turn, loads, index) == 0
    # A later turn whose 1,024-token history replica 0 holds costs 46 ms more elsewhere: it stays (on the
    # estimate alone, without the private copy charge).
    later_turn = request(prompt_len=1152)
    estimate_only = policy_after([0] * 200, private_copy_charge=0)
    assert estimate_only.select(later_turn, loads, index_with({0: 64}, later_turn)) == 0
    with pytest.raises(ValueError, match="spread_tolerance_steps"):
        CostTTFTPolicy(model, spread_tolerance_steps=-1)


def test_cost_ttft_waits_for_the_step_in_flight_on_a_replica_computing_a_long_prompt() -> None:
    req = request(prompt_len=2304)
    index = index_with({0: 16}, req)  # replica 0 caches a 256-token system prompt
    policy = CostTTFTPolicy(StepCostModel.default(), min_match_fraction=0)

    def loads(in_flight: int) -> list[ReplicaLoad]:
        return [ReplicaLoad(0, num_running=1, num_inflight_prefill_tokens=in_flight), ReplicaLoad(1)]

    assert policy.select(req, loads(0), index) == 0  # decoding one request: the system prompt wins
    # Half of a 2,000-token step (53 ms) outweighs the 256 cached tokens (13 ms).
    assert policy.select(req, loads(2000), index) == 1
    assert policy.estimate_ttft(req, loads(2000), index)[0] == pytest.approx(
        policy.estimate_ttft(req, loads(0), index)[0] + 0.5 * 2000 * StepCostModel.default().b
    )


def test_cost_ttft_counts_a_match_of_under_a_tenth_of_the_prompt_as_none() -> None:
    model = StepCostModel.default()
    busy = ReplicaLoad(0, num_running=4, num_running_tokens=8000)
    cold = request(prompt_len=2688)  # a session's history no replica holds, after a shared system prompt
    index = index_with({0: 16}, cold)  # 256 tokens: 9.5% of the prompt

    assert CostTTFTPolicy(model).select(cold, [busy, ReplicaLoad(1)], index) == 1
    assert CostTTFTPolicy(model, min_match_fraction=0).select(cold, [busy, ReplicaLoad(1)], index) == 0
    assert CostTTFTPolicy(model).estimate_ttft(cold, [ReplicaLoad(0), ReplicaLoad(1)], index).tolist() == [
        pytest.approx(2 * model.a + 2688 * model.b)
    ] * 2
    # A tenth or more counts: a new session's first turn, its system prompt cached.
    first_turn = request(prompt_len=384)
    assert CostTTFTPolicy(model).select(first_turn, [busy, ReplicaLoad(1)], index_with({0: 16}, first_turn)) == 0


def test_cost_ttft_spreads_a_hot_prefix_once_its_replica_decodes_a_far_bigger_batch() -> None:
    req = request(prompt_len=2176)
    index = index_with({0: 136}, req)  # replica 0 holds the whole 2048-token system prompt

    def fleet(running_on_0: int, running_on_1: int) -> list[ReplicaLoad]:
        return [
            ReplicaLoad(r, num_running=n, num_running_tokens=n * 2300, num_free_blocks=1000, num_total_blocks=1000)
            for r, n in enumerate((running_on_0, running_on_1))
        ]

    policy = CostTTFTPolicy(MODEL, decode_horizon=64, load_factor=None)
    assert policy.select(req, fleet(12, 4), index) == 0  # a few more decodes: the hit wins
    assert policy.select(req, fleet(200, 4), index) == 1  # a huge batch: decoding there costs more than the miss
    assert CostTTFTPolicy(MODEL, load_factor=None).select(req, fleet(200, 4), index) == 0  # TTFT alone
    one_token = RoutingRequest(req.req_id, req.block_hashes, req.num_prompt_tokens, BLOCK_SIZE, max_output_tokens=1)
    assert policy.select(one_token, fleet(200, 4), index) == 0  # nothing to decode: TTFT alone decides
    with pytest.raises(ValueError, match="decode_horizon"):
        CostTTFTPolicy(MODEL, decode_horizon=-1)


def test_cost_ttft_with_bounded_loads_skips_a_replica_over_the_bound() -> None:
    req = request(prompt_len=1600)
    index = index_with({0: 99}, req)
    loads = with_outstanding([6, 1, 1, 0])  # bound = ceil(1.25 * 9 / 4) = 3

    assert CostTTFTPolicy(MODEL, load_factor=None).select(req, loads, index) == 0
    assert CostTTFTPolicy(MODEL, load_factor=1.25, load_slack=0).select(req, loads, index) == 3
    assert CostTTFTPolicy(MODEL, load_slack=0).select(req, loads, index) == 3  # 2x: ceil(2 * 9 / 4) = 5 < 6 + 1
    assert CostTTFTPolicy(MODEL, load_slack=0).select(req, with_outstanding([3, 2, 2, 1]), index) == 0  # 4 <= 5
    # The default slack of 8 requests: small fleets' loads (and everyone's, at start-up) are never bound.
    assert CostTTFTPolicy(MODEL).select(req, loads, index) == 0
    assert CostTTFTPolicy(MODEL).select(req, with_outstanding([20, 1, 1, 0]), index) == 3  # 21 > ceil(2 * 23 / 4) + 8
    with pytest.raises(ValueError, match="load_slack"):
        CostTTFTPolicy(MODEL, load_slack=-1)


def test_cost_ttft_with_a_share_bound_spreads_a_hot_prefix_once_its_replica_had_more_than_its_share() -> None:
    req = request(prompt_len=1600)
    # Only replica 0 holds the prompt; the loads stay idle, and the others have served other prompts.
    index = served_other_prompts(index_with({0: 99}, req), 1, 2, 3)
    unbound = CostTTFTPolicy(MODEL, share_factor=None)
    bound = CostTTFTPolicy(MODEL)  # the defaults: factor 2, 3 deviations, slack 8

    assert [unbound.select(req, idle(4), index) for _ in range(24)] == [0] * 24
    # After 18 requests the mean is 4.5: 18 + 1 > 4.5 + 3 * sqrt(4.5) + 8 = 18.86 (the chance term is
    # more than 2 x the mean here).  The 19th goes to another replica; with it counted, replica 0 is
    # within its share again.
    assert [bound.select(req, idle(4), index) for _ in range(20)] == [0] * 18 + [1, 0]


def test_cost_ttft_with_a_share_bound_keeps_prefixes_home_when_their_popularity_is_balanced() -> None:
    prompts = [request(prompt_len=1600, seed=s) for s in range(4)]
    index = GlobalPrefixIndex()
    for replica_id, req in enumerate(prompts):
        index.add_blocks(replica_id, list(req.block_hashes[:99]))
    policy = CostTTFTPolicy(MODEL, share_factor=1.2, share_slack=2.0)
    draws = np.random.default_rng(0).integers(0, 4, size=2000)  # equal popularity, chance imbalance

    choices = [policy.select(prompts[p], idle(4), index) for p in draws]

    assert choices == draws.tolist()
    with pytest.raises(ValueError, match="share_factor"):
        CostTTFTPolicy(MODEL, share_factor=1.0)


def test_cost_ttft_share_bound_gives_way_when_the_other_bounds_leave_no_other_replica() -> None:
    req = request(prompt_len=1600)
    index = index_with({2: 99}, req)
    policy = CostTTFTPolicy(MODEL, load_factor=1.25, load_slack=0, share_factor=1.2, share_slack=2.0)
    for _ in range(30):
        policy.recent_share.record(2, 3)  # mean over replicas 1 and 2: 15; 31 > 15 + 3 * sqrt(15) + 2 = 28.6
    loads = with_outstanding([0, 6, 1])
    loads[0] = ReplicaLoad(0, available=False)  # the fewest outstanding, but out of the running

    assert policy.recent_share.over_share(np.array([False, True, True]), 3).tolist() == [False, False, True]
    assert policy.select(req, with_outstanding([0, 6, 1]), index) == 0  # all available: spill to the idle one
    # Replica 1 is over the load bound (7 > ceil(1.25 * 8 / 2) = 5), replica 0 unavailable: the share bound
    # gives way rather than leave no replica at all.
    assert policy.select(req, loads, index) == 2


def queued(replica_id: int, waiting: int, tokens: int) -> ReplicaLoad:
    return ReplicaLoad(
        replica_id, num_waiting=waiting, num_queued_prefill_tokens=tokens, num_free_blocks=1000, num_total_blocks=1000
    )


def test_cost_ttft_keeps_a_request_on_its_cached_replica_when_the_whole_fleet_is_backlogged() -> None:
    req = request(prompt_len=1600)
    index = index_with({0: 99}, req)
    # Replica 0 holds the prompt but has 3000 more queued tokens than replica 1: alone, a miss there is faster.
    spread = [queued(0, 6, 4000), queued(1, 0, 1000)]
    backlogged = [queued(0, 6, 4000), queued(1, 2, 1000)]
    # Every match counted shared: the backlog is the fewest requests waiting on any replica.
    fewest = dict(shared_match_window=None)

    assert CostTTFTPolicy(MODEL, **fewest).select(req, spread, index) == 1  # replica 1 has no queue: spill
    assert CostTTFTPolicy(MODEL, **fewest).select(req, backlogged, index) == 0  # every replica queues: keep the hit
    assert CostTTFTPolicy(MODEL, **fewest, work_penalty=0).select(req, backlogged, index) == 1


def test_cost_ttft_keeps_a_private_prefix_on_its_replica_under_backlog_and_spills_a_shared_one() -> None:
    prompt = [(i * 31) % 30_000 + 3 for i in range(1600)]
    # Two requests whose matches end at the same block (the 99th): the second finds the prefix shared.
    first = RoutingRequest("first", HASHER.hash_token_ids(prompt), 1600, BLOCK_SIZE)
    sibling = prompt[:1584] + [7] * 16
    second = RoutingRequest("second", HASHER.hash_token_ids(sibling), 1600, BLOCK_SIZE)
    index = index_with({0: 99}, first)
    # Replica 0 holds 99 blocks but queues 3000 tokens more than replica 1, which has no queue.
    spread = [queued(0, 6, 4000), queued(1, 0, 1000)]
    # Without the private copy charge, which alone would keep the first request (its own test is below).
    policy = CostTTFTPolicy(MODEL, private_copy_charge=0)

    # Private (no earlier prompt went on from its last block, no other match ended there): the
    # mean backlog (3 requests) prices the 1,584 tokens a move recomputes above the 3,000 it skips.
    assert policy.select(first, spread, index) == 0
    # Shared: the fewest waiting is 0, a copy on replica 1 costs nobody else: spill.
    assert policy.select(second, spread, index) == 1
    # Without the distinction every match is shared.
    every_match_shared = CostTTFTPolicy(MODEL, shared_match_window=None, private_copy_charge=0)
    assert every_match_shared.select(first, spread, index) == 1


def test_cost_ttft_keeps_a_private_prefix_on_its_replica_mid_way_through_another_prompt() -> None:
    prompt = [(i * 37) % 30_000 + 3 for i in range(800)]
    turn = RoutingRequest("turn", HASHER.hash_token_ids(prompt), 800, BLOCK_SIZE)
    sibling = RoutingRequest("sibling", HASHER.hash_token_ids(prompt[:640] + [7] * 160), 800, BLOCK_SIZE)
    index = index_with({0: 40}, turn)  # replica 0 holds 640 of the 800 tokens
    # Replica 0 is computing a 1,500-token prompt: half of that step is 75 ms more to wait there, more than
    # the 64 ms that 640 cached tokens save; replica 1 runs only a decode.
    loads = [
        ReplicaLoad(0, num_running=1, num_inflight_prefill_tokens=1500, num_free_blocks=1000, num_total_blocks=1000),
        ReplicaLoad(1, num_running=1, num_free_blocks=1000, num_total_blocks=1000),
    ]

    assert CostTTFTPolicy(MODEL, private_copy_charge=0).select(turn, loads, index) == 1  # the estimate alone
    # Private (its match ends where no prompt went on): a copy on replica 1 is charged its 640 tokens again.
    policy = CostTTFTPolicy(MODEL)
    assert policy.select(turn, loads, index) == 0
    # The sibling's match ends at the same block: shared, a second holder is worth having, no charge.
    assert policy.select(sibling, loads, index) == 1


def test_cost_ttft_sends_a_shared_prefix_held_by_one_replica_to_an_empty_replica() -> None:
    """An empty replica (no request, no block) takes a second copy of a shared prefix; nothing else does."""
    req = request(prompt_len=1600)  # 100 blocks: replica 0 holds the first 99, a prefix earlier prompts went on from
    loads = idle(3)

    policy_seeing_forks = functools.partial(forked_policy, req, MODEL)

    index = served_other_prompts(index_with({0: 99}, req), 1)  # replica 2 is empty
    assert policy_seeing_forks().select(req, loads, index) == 2
    assert policy_seeing_forks(copy_to_empty=False).select(req, loads, index) == 0
    # A private match (no earlier prompt went on from its end: a session's history) stays.
    assert CostTTFTPolicy(MODEL).select(req, loads, index) == 0
    # Not empty: serving a request, or with blocks on their way to it.
    assert policy_seeing_forks().select(req, with_outstanding([0, 0, 1]), index) == 0
    pending = served_other_prompts(index_with({0: 99}, req), 1)
    pending.add_pending(2, request(prompt_len=32, seed=7).block_hashes)
    assert policy_seeing_forks().select(req, loads, pending) == 0
    # Two holders already (replica 2 is empty in this index too): the estimate decides between them.
    assert policy_seeing_forks().select(req, loads, index_with({0: 99, 1: 99}, req)) in (0, 1)
    # A replica whose cache was cleared (restarted) is empty again.
    index.clear_replica(1)
    assert policy_seeing_forks().select(req, loads, index) == 1


def test_cost_ttft_breaks_ties_among_some_holders_of_a_shared_prefix_by_their_recent_requests() -> None:
    """Holders of a shared prefix that also serve other prefixes: fewest outstanding requests would keep
    feeding the one whose queue happens to be shorter; the fewest requests lately balances them."""
    req = request(prompt_len=1600)
    loads = with_outstanding([3, 2, 0])

    policy_after = functools.partial(forked_policy, req, MODEL, num_replicas=3)

    routed = [1] * 60 + [0] * 30 + [2] * 30
    some = served_other_prompts(index_with({0: 99, 1: 99}, req), 2)  # replicas 0 and 1 hold it
    estimate = policy_after(routed).estimate_ttft(req, loads, some)
    assert abs(estimate[0] - estimate[1]) < 0.5 * MODEL.a  # a tie
    assert policy_after(routed).select(req, loads, some) == 0
    assert policy_after(routed, holder_share_ties=False).select(req, loads, some) == 1
    # Held by every replica (a system prompt): the fewest outstanding requests, as for any tie.
    every = index_with({0: 99, 1: 99, 2: 99}, req)
    assert policy_after([2] * 60 + [0, 1] * 30).select(req, with_outstanding([3, 2, 1]), every) == 2
    with pytest.raises(ValueError, match="holder_share_ties"):
        CostTTFTPolicy(MODEL, holder_share_ties=1)
    with pytest.raises(ValueError, match="copy_to_empty"):
        CostTTFTPolicy(MODEL, copy_to_empty="yes")
