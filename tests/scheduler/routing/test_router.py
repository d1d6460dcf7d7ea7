"""The router: one hashing per request, shared with the pool; routing on real schedulers."""

from __future__ import annotations

import pytest

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.request import Request
from kvserve.scheduler.routing.policies import make_policy
from kvserve.scheduler.routing.router import Router
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler

BLOCK_SIZE = 4


def fleet(policy: str, num_replicas: int = 3, **policy_args) -> tuple[Router, list[Scheduler]]:
    router = Router(num_replicas, make_policy(policy, **policy_args), BLOCK_SIZE, model_id="m")
    schedulers = [
        Scheduler(
            SchedulerConfig(max_num_batched_tokens=256, max_model_len=256),
            CacheConfig(block_size=BLOCK_SIZE, num_blocks=64, model_id="m"),
            observer=router.observer_for(r),
        )
        for r in range(num_replicas)
    ]
    return router, schedulers


def serve(router: Router, schedulers: list[Scheduler], request: Request) -> int:
    replica_id = router.route(request)
    scheduler = schedulers[replica_id]
    scheduler.add_request(request)
    router.update_load(replica_id, scheduler.get_load())
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        scheduler.update(plan, [5] * plan.num_sampled)
    router.update_load(replica_id, scheduler.get_load())
    return replica_id


def test_route_hashes_the_prompt_once_and_the_pool_reuses_the_hashes() -> None:
    router, schedulers = fleet("round_robin")
    request = Request("a", list(range(22)), SamplingParams(max_tokens=1), cache_salt="s")

    replica_id = router.route(request)
    hashes = list(request.block_hashes)

    assert hashes == schedulers[0].kv_cache_manager.hasher.hash_token_ids(list(range(22)), "s")
    schedulers[replica_id].add_request(request)
    schedulers[replica_id].schedule()
    assert request.block_hashes[: len(hashes)] == hashes
    assert router.index.match(hashes) == {replica_id: 5}


def test_a_repeated_prompt_goes_back_to_the_replica_that_cached_it() -> None:
    router, schedulers = fleet("cache_aware")
    prompt = list(range(3, 43))
    first = serve(router, schedulers, Request("a", prompt, SamplingParams(max_tokens=2)))
    serve(router, schedulers, Request("x", list(range(100, 140)), SamplingParams(max_tokens=2)))

    again = Request("b", prompt + [7], SamplingParams(max_tokens=2))
    assert serve(router, schedulers, again) == first
    assert again.num_cached_tokens == 40


def test_another_tenant_with_the_same_prompt_finds_no_cached_prefix() -> None:
    router, schedulers = fleet("cache_aware")
    prompt = list(range(3, 43))
    serve(router, schedulers, Request("a", prompt, SamplingParams(max_tokens=2), cache_salt="tenant-a"))

    other = Request("b", prompt, SamplingParams(max_tokens=2), cache_salt="tenant-b")
    router.route(other)

    assert router.index.match(other.block_hashes) == {}
    replica_id = serve(router, schedulers, Request("c", prompt, SamplingParams(max_tokens=2), cache_salt="tenant-b"))
    assert schedulers[replica_id].kv_cache_manager.prefix_cache_stats.num_hit_tokens == 0


def test_router_rejects_a_replica_out_of_range() -> None:
    router, _ = fleet("round_robin", num_replicas=2)

    with pytest.raises(ValueError):
        router.observer_for(2)

    class Rogue:
        name = "rogue"

        def select(self, request, replicas, index):  # noqa: ANN001, ANN201
            return 5

    router.policy = Rogue()
    with pytest.raises(ValueError, match="chose replica 5"):
        router.route(Request("a", [1, 2, 3], SamplingParams()))
