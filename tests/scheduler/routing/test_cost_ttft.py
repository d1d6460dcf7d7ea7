"""cost_ttft: the replica with the lowest estimated time to first token, in hand-made situations."""

from __future__ import annotations

import pytest

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.request import Request
from kvserve.scheduler.routing.cost_ttft import CostTTFTPolicy
from kvserve.scheduler.routing.load import ReplicaLoad
from kvserve.scheduler.routing.policy import RoutingRequest
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex
from kvserve.scheduler.routing.router import Router
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from tests.scheduler.routing.test_policies import BLOCK_SIZE, idle, index_with, request, with_outstanding

MODEL = StepCostModel(a=0.01, b=1e-4, c=1e-4, d=0.0)


# -- the estimate ------------------------------------------------------------------------------


def test_the_estimate_prices_the_queue_the_step_in_flight_and_the_uncached_tokens() -> None:
    req = request(prompt_len=1000)  # 62 full blocks; at most 992 tokens can hit
    index = index_with({1: 62}, req)
    loads = [
        ReplicaLoad(0, num_running=48, num_queued_prefill_tokens=3000, num_running_tokens=10_000,
                    num_inflight_prefill_tokens=1000),
        ReplicaLoad(1),
    ]
    policy = CostTTFTPolicy(StepCostModel(a=0.01, b=1e-4, c=1e-3, d=1e-6), max_num_batched_tokens=2048)

    ttft = policy.estimate_ttft(req, loads, index)

    # Replica 0: half the step in flight (a step of 0.01 + 0.048 + 0.01 s, and 1000 prefill tokens),
    # then 3000 queued + 1000 own tokens in ceil(4000 / 2000) = 2 such steps.
    step = 0.01 + 48e-3 + 10_000e-6
    assert ttft[0] == pytest.approx(0.5 * (step + 1000e-4) + 2 * step + 4000e-4)
    # Replica 1, idle: the 8 tokens its cache does not hold, in one step.
    assert ttft[1] == pytest.approx(0.01 + 8e-4)


def test_the_queue_counts_only_the_tokens_its_requests_will_compute() -> None:
    req = request(prompt_len=1000)
    index = index_with({1: 62}, req)
    model = StepCostModel(a=0.01, b=1e-4, c=0.0, d=0.0)
    loads = [
        # 2000 queued tokens of which 1000 were cached when queued, plus 1000 of its own: 2000 tokens
        # of work; with 49 decodes running, 1999 per step: 2 steps (a budget of 2048 would take 1).
        ReplicaLoad(0, num_running=49, num_queued_prefill_tokens=2000, num_queued_cached_tokens=1000),
        ReplicaLoad(1),
    ]

    ttft = CostTTFTPolicy(model, max_num_batched_tokens=2048).estimate_ttft(req, loads, index)

    assert ttft[0] == pytest.approx(0.5 * 0.01 + 2 * 0.01 + 2000e-4)


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    model = StepCostModel(a=0.01, b=1e-4, c=0.0, d=0.0)
    whole = request(prompt_len=992)  # exactly 62 blocks: the last one is computed again

    ttft = CostTTFTPolicy(model).estimate_ttft(whole, [ReplicaLoad(0)], index_with({0: 62}, whole))

    assert ttft[0] == pytest.approx(0.01 + 16e-4)


# -- the choice ----------------------------------------------------------------------------------


def test_a_request_goes_to_the_replica_holding_its_prefix() -> None:
    req = request(prompt_len=1600)

    assert CostTTFTPolicy(MODEL).select(req, idle(4), index_with({3: 90}, req)) == 3


def test_a_request_goes_to_the_longest_prefix_among_holders() -> None:
    req = request(prompt_len=1600)

    assert CostTTFTPolicy(MODEL).select(req, idle(3), index_with({0: 30, 1: 90, 2: 60}, req)) == 1


def test_a_request_leaves_its_prefix_when_that_replicas_queue_costs_more_than_the_miss() -> None:
    req = request(prompt_len=1600)
    index = index_with({0: 99}, req)
    # Room on both (where neither had room, the request would stay with its prefix).
    light = [ReplicaLoad(0, num_running=1, num_waiting=1, num_queued_prefill_tokens=1000, num_free_blocks=1000),
             ReplicaLoad(1, num_free_blocks=1000)]
    heavy = [ReplicaLoad(0, num_running=1, num_waiting=4, num_queued_prefill_tokens=8000, num_free_blocks=1000),
             ReplicaLoad(1, num_free_blocks=1000)]

    # 1000 queued tokens (0.1 s) cost less than computing 1600 elsewhere (0.16 s); 8000 cost more.
    assert CostTTFTPolicy(MODEL).select(req, light, index) == 0
    assert CostTTFTPolicy(MODEL).select(req, heavy, index) == 1


def test_a_request_waits_for_the_step_in_flight_on_a_replica_computing_a_long_prompt() -> None:
    # Replica 0 holds a quarter of the prompt but is computing 2000 prompt tokens (0.2 s):
    # half of that step costs more than the 400 tokens its cache saves (0.04 s).
    req = request(prompt_len=1600)
    index = index_with({0: 25}, req)
    loads = [ReplicaLoad(0, num_running=1, num_inflight_prefill_tokens=2000, num_free_blocks=1000),
             ReplicaLoad(1, num_free_blocks=1000)]

    assert CostTTFTPolicy(MODEL).select(req, loads, index) == 1
    idle_holder = [ReplicaLoad(0, num_running=1, num_free_blocks=1000), ReplicaLoad(1, num_free_blocks=1000)]
    assert CostTTFTPolicy(MODEL).select(req, idle_holder, index) == 0


def test_a_near_tie_goes_to_the_replica_with_the_fewest_outstanding_requests() -> None:
    # Replica 0 saves a block (1.6 ms), under half a step (5 ms): a tie, and replica 1 has fewer requests.
    req = request(prompt_len=1600)
    index = index_with({0: 1, 1: 0}, req)
    loads = [ReplicaLoad(r, num_waiting=w, num_free_blocks=1000) for r, w in enumerate([3, 1, 2])]

    assert CostTTFTPolicy(MODEL).select(req, loads, index) == 1
    # Without a tolerance the block decides.
    assert CostTTFTPolicy(MODEL, tie_tolerance_steps=0).select(req, loads, index) == 0


def test_equal_estimates_go_to_the_fewest_outstanding_then_the_lowest_id() -> None:
    loads = [ReplicaLoad(r, num_waiting=w) for r, w in enumerate([2, 1, 0, 0])]

    assert CostTTFTPolicy(MODEL).select(request(), loads, GlobalPrefixIndex()) == 2


def test_a_prompt_no_replica_holds_goes_to_the_replica_caching_the_fewest_blocks() -> None:
    # Replica 0 has fewer requests but caches two other prompts; replica 1 caches one.
    other = [request(prompt_len=160, seed=s) for s in (11, 12)]
    index = GlobalPrefixIndex()
    index.add_blocks(0, list(other[0].block_hashes) + list(other[1].block_hashes))
    index.add_blocks(1, list(other[0].block_hashes))
    loads = [ReplicaLoad(0), ReplicaLoad(1, num_waiting=1)]

    assert CostTTFTPolicy(MODEL).select(request(seed=1), loads, index) == 1
    # A prompt replica 0 holds a block of is no new prefix: its tie goes by requests alone.
    held = request(prompt_len=1600, seed=11)
    assert CostTTFTPolicy(MODEL).select(held, loads, index_with({0: 1}, held)) == 0


def test_a_replica_at_the_load_bound_takes_no_more_requests() -> None:
    req = request(prompt_len=1600)
    index = index_with({0: 90}, req)
    loads = with_outstanding([6, 1, 1, 1])  # mean 9 / 4; bound ceil(2 * 10 / 4) + slack

    assert CostTTFTPolicy(MODEL, load_factor=None).select(req, loads, index) == 0
    assert CostTTFTPolicy(MODEL, load_slack=0).select(req, loads, index) in (1, 2, 3)  # 6 >= 5
    assert CostTTFTPolicy(MODEL).select(req, loads, index) == 0  # 6 < 5 + 8
    assert CostTTFTPolicy(MODEL, load_slack=0).select(req, with_outstanding([3, 2, 2, 1]), index) == 0


def test_an_unavailable_replica_is_never_chosen_even_holding_the_prefix() -> None:
    req = request(prompt_len=1600)
    loads = [ReplicaLoad(0, available=False), ReplicaLoad(1, num_waiting=5, num_queued_prefill_tokens=5000)]

    assert CostTTFTPolicy(MODEL).select(req, loads, index_with({0: 99}, req)) == 1


@pytest.mark.parametrize(
    ("argument", "value"),
    [("tie_tolerance_steps", -0.5), ("load_factor", 0.5), ("load_slack", 1.5), ("max_num_batched_tokens", 1)],
)
def test_bad_arguments_are_refused(argument: str, value: object) -> None:
    with pytest.raises(ValueError, match=argument):
        CostTTFTPolicy(MODEL, **{argument: value})


# -- room in the KV cache ------------------------------------------------------------------------


def replica_running(router: Router, replica_id: int, prompt: list[int], num_blocks: int) -> Scheduler:
    """A real scheduler of ``num_blocks`` usable blocks, decoding ``prompt`` (its blocks held), its load recorded."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=2048, max_model_len=2048),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks + 1),
        observer=router.observer_for(replica_id),
        queue_observer=router.queue_observer_for(replica_id),
    )
    if prompt:
        scheduler.add_request(Request(f"running-{replica_id}", prompt, SamplingParams(max_tokens=100)))
        plan = scheduler.schedule()
        scheduler.update(plan, [5] * plan.num_sampled)
    router.update_load(replica_id, scheduler.get_load())
    return scheduler


def test_a_request_goes_where_the_kv_cache_has_room_for_it_not_to_a_cheaper_replica_without() -> None:
    # Replica 0 decodes a request that shares the new prompt's first 20 blocks and holds 25 of
    # its 32 blocks; replica 1 is idle.  Computing 160 tokens after half a step on replica 0 is
    # cheaper than 480 on replica 1, but replica 0 has 7 free blocks for the 10 it would allocate.
    policy = CostTTFTPolicy(MODEL)
    router = Router(2, policy, BLOCK_SIZE)
    shared = list(range(3, 323))
    schedulers = [replica_running(router, 0, shared + [7] * 80, 32), replica_running(router, 1, [], 32)]
    new = Request("new", shared + [9] * 160, SamplingParams(max_tokens=10))
    router.hash_prompt(new)
    routing_request = RoutingRequest("new", new.block_hashes, new.num_prompt_tokens, BLOCK_SIZE)

    ttft = policy.estimate_ttft(routing_request, router.loads, router.index)
    assert ttft[0] < ttft[1] - 0.5 * MODEL.a
    assert router.route(new) == 1
    assert policy.has_room(routing_request, router.loads, router.index).tolist() == [False, True]
    # What the estimate alone would have cost: replica 0 does not admit the request while its
    # running request decodes.
    schedulers[0].add_request(new)
    schedulers[0].schedule()
    assert [r.req_id for r in schedulers[0].waiting] == ["new"]


def test_room_counts_the_blocks_of_the_queue_ahead() -> None:
    req = request(prompt_len=320)  # 20 blocks
    loads = [
        # 30 free blocks: 20 of its own fit, but not after the queue's 800 uncached tokens (50 blocks).
        ReplicaLoad(0, num_waiting=1, num_queued_prefill_tokens=1600, num_queued_cached_tokens=800,
                    num_free_blocks=30, num_total_blocks=100),
        ReplicaLoad(1, num_waiting=1, num_queued_prefill_tokens=1600, num_queued_cached_tokens=1600,
                    num_free_blocks=30, num_total_blocks=100),
    ]

    assert CostTTFTPolicy(MODEL).has_room(req, loads, GlobalPrefixIndex()).tolist() == [False, True]


def test_where_no_replica_has_room_the_estimate_decides() -> None:
    req = request(prompt_len=1600)  # 100 blocks, none held
    loads = [
        ReplicaLoad(0, num_running=1, num_waiting=2, num_queued_prefill_tokens=3000, num_free_blocks=50),
        ReplicaLoad(1, num_running=1, num_free_blocks=50),
    ]

    assert CostTTFTPolicy(MODEL).select(req, loads, GlobalPrefixIndex()) == 1


def test_where_no_replica_has_room_a_request_goes_to_its_longest_cached_prefix() -> None:
    # Each replica decodes a request holding 25 of its 32 blocks; replica 0's shares the new
    # prompt's first 20 blocks and has a 480-token prompt queued.  Neither has room (replica 0
    # needs 40 blocks for its queue and the request, replica 1 30), and the estimate is lower on
    # replica 1 (480 tokens to compute against 640), where the request would compute the 320
    # tokens replica 0 holds and keep a second copy of them.
    policy = CostTTFTPolicy(MODEL)
    router = Router(2, policy, BLOCK_SIZE)
    shared = list(range(3, 323))
    schedulers = [replica_running(router, 0, shared + [7] * 80, 32),
                  replica_running(router, 1, list(range(1003, 1403)), 32)]
    queued = Request("queued", list(range(2003, 2483)), SamplingParams(max_tokens=10))
    router.hash_prompt(queued)
    schedulers[0].add_request(queued)
    router.update_load(0, schedulers[0].get_load())
    new = Request("new", shared + [9] * 160, SamplingParams(max_tokens=10))
    router.hash_prompt(new)
    routing_request = RoutingRequest("new", new.block_hashes, new.num_prompt_tokens, BLOCK_SIZE)

    assert policy.has_room(routing_request, router.loads, router.index).tolist() == [False, False]
    ttft = policy.estimate_ttft(routing_request, router.loads, router.index)
    assert ttft[1] < ttft[0] - 0.5 * MODEL.a
    assert router.route(new) == 0


def test_where_no_replica_has_room_the_estimate_decides_among_the_longest_prefix_holders() -> None:
    # None has room (5 free blocks each).  Replica 2 (30 blocks cached, nothing
    # queued) has the lowest estimate, 1120 tokens to compute against replica 1's 1000 queued and 160
    # of its own; of the two caching 90 blocks, replica 1 has the shorter queue.
    req = request(prompt_len=1600)  # 100 blocks
    index = index_with({0: 90, 1: 90, 2: 30}, req)
    loads = [
        ReplicaLoad(0, num_running=1, num_waiting=2, num_queued_prefill_tokens=3000, num_free_blocks=5),
        ReplicaLoad(1, num_running=1, num_waiting=1, num_queued_prefill_tokens=1000, num_free_blocks=5),
        ReplicaLoad(2, num_running=1, num_free_blocks=5),
        ReplicaLoad(3, num_running=1, num_free_blocks=5),
    ]

    assert CostTTFTPolicy(MODEL).select(req, loads, index) == 1


def test_where_no_replica_has_room_a_holder_at_the_load_bound_takes_no_more() -> None:
    req = request(prompt_len=1600)
    index = index_with({0: 90}, req)
    # 5 free blocks each; mean 9 / 4 outstanding, bound ceil(2 * 10 / 4) + slack.
    loads = [ReplicaLoad(r, num_running=n, num_free_blocks=5) for r, n in enumerate([6, 1, 1, 1])]

    assert CostTTFTPolicy(MODEL).select(req, loads, index) == 0  # 6 < 5 + 8
    assert CostTTFTPolicy(MODEL, load_slack=0).select(req, loads, index) in (1, 2, 3)  # 6 >= 5
