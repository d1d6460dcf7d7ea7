"""A tenant's share of the prefix cache (``tenant_cache_share``, ``TenantBlockPool``), on the
real Scheduler and pool: one tenant's flood of unique prompts cannot evict another's prefix."""

from __future__ import annotations

import pytest

from kvserve.scheduler.block_pool import BlockPool
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.engine_config import EngineConfig
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.tenant_block_pool import TenantBlockPool
from tests.scheduler.test_tenant_block_pool_properties import assert_tenant_invariants

BLOCK_SIZE = 4
NUM_BLOCKS = 41  # 40 usable
PREFIX = list(range(100, 100 + 4 * BLOCK_SIZE))  # alice's shared prefix: four blocks


def make_scheduler(share: float | None) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, tenant_cache_share=share),
    )


def tenant_request(req_id: str, prompt: list[int], tenant: str | None) -> Request:
    # Salted by tenant, as the front end does (cluster.auth.tenant_cache_salt).
    salt = None if tenant is None else f"tenant={tenant}\x00"
    return Request(req_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True), cache_salt=salt, tenant=tenant)


def run(scheduler: Scheduler, *requests: Request) -> list[StepPlan]:
    """Serve ``requests`` to the end; the plans of the steps."""
    for request in requests:
        scheduler.add_request(request)
    plans = []
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        scheduler.update(plan, [7] * plan.num_sampled)
        plans.append(plan)
    return plans


def flood(scheduler: Scheduler, tenant: str | None, num_prompts: int = 20, start: int = 0) -> None:
    """``num_prompts`` unique prompts of three full blocks each: 60 blocks through a 40-block pool."""
    for i in range(start, start + num_prompts):
        prompt = [1000 + 16 * i + j for j in range(3 * BLOCK_SIZE)]
        run(scheduler, tenant_request(f"{tenant}-flood-{i}", prompt, tenant))


def alice_hits_after_bob_floods(share: float | None) -> int:
    scheduler = make_scheduler(share)
    run(scheduler, tenant_request("alice-1", [*PREFIX, 1, 2], "alice"))
    flood(scheduler, "bob")
    again = tenant_request("alice-2", [*PREFIX, 3, 4], "alice")
    run(scheduler, again)
    return again.num_cached_tokens or 0


def test_without_a_share_one_tenant_s_flood_evicts_another_tenant_s_prefix() -> None:
    assert alice_hits_after_bob_floods(None) == 0


# NOTE: 0.8 is the most of the pool bob may keep and still leave alice's four blocks (and one
# request's three over his share): 0.9 x 40 = 36 is his, and his 37th block would be hers.
@pytest.mark.parametrize("share", [0.25, 0.5, 0.8])
def test_with_a_share_another_tenant_s_prefix_survives_the_flood_and_is_hit(share: float) -> None:
    assert alice_hits_after_bob_floods(share) == len(PREFIX)


def test_a_flooding_tenant_over_its_share_recycles_its_own_cache() -> None:
    scheduler = make_scheduler(0.5)
    pool = scheduler.kv_cache_manager.block_pool
    assert isinstance(pool, TenantBlockPool)
    run(scheduler, tenant_request("alice-1", [*PREFIX, 1, 2], "alice"))
    flood(scheduler, "bob")

    # Bob keeps the rest of the pool, past his share only by the blocks of one request.
    assert pool.cached_blocks_by_tenant() == {"alice": 4, "bob": 36}
    assert pool.max_cached_blocks_per_tenant == 20
    assert_tenant_invariants(pool)


def test_a_tenant_alone_fills_the_whole_pool_whatever_its_share() -> None:
    scheduler = make_scheduler(0.1)
    pool = scheduler.kv_cache_manager.block_pool
    flood(scheduler, "bob", num_prompts=13)  # 39 blocks: the share binds only against another's cache

    assert pool.num_cached_blocks("bob") == 39
    # Past the pool, it recycles its least recently used blocks: the last free one, then its
    # first prompt's last two (a finished request's blocks are freed last first: its prefix goes last).
    flood(scheduler, "bob", num_prompts=1, start=13)
    run(scheduler, first := tenant_request("again", [1000 + j for j in range(3 * BLOCK_SIZE)], "bob"))
    assert first.num_cached_tokens == BLOCK_SIZE


def cached_by(pool: TenantBlockPool, tenant: str, num_blocks: int, *, free: bool = True) -> list:
    """``num_blocks`` new blocks that ``tenant``'s request caches (hashes of its own), then frees unless ``free`` is
    false (the request still runs)."""
    blocks = pool.get_new_blocks(num_blocks, tenant)
    pool.cache_full_blocks(blocks, [f"{tenant}{i}".encode().ljust(16) for i in range(num_blocks)], 0, num_blocks, tenant)
    if free:
        pool.free_blocks(blocks)
    return blocks


def test_over_its_share_a_tenant_takes_free_uncached_blocks_then_its_own_then_another_s() -> None:
    pool = TenantBlockPool(11, share=0.2)  # 10 usable blocks, at most 2 cached per tenant within the share
    cached_by(pool, "alice", 2)
    cached_by(pool, "bob", 3)
    assert [b.block_id for b in pool.free_block_queue] == [6, 7, 8, 9, 10, 1, 2, 3, 4, 5]

    # Bob (3 cached, over 2): the uncached head first, then his own LRU block rather than alice's 1.
    assert [b.block_id for b in pool.get_new_blocks(6, "bob")] == [6, 7, 8, 9, 10, 3]
    assert pool.cached_blocks_by_tenant() == {"alice": 2, "bob": 2}
    assert_tenant_invariants(pool)


def test_over_its_share_with_no_free_cached_block_of_its_own_a_tenant_takes_the_head() -> None:
    pool = TenantBlockPool(11, share=0.2)
    cached_by(pool, "alice", 2)
    cached_by(pool, "bob", 3, free=False)  # held: running

    # Running requests are never refused a block that is free.
    assert [b.block_id for b in pool.get_new_blocks(6, "bob")] == [6, 7, 8, 9, 10, 1]
    assert pool.cached_blocks_by_tenant() == {"alice": 1, "bob": 3}
    assert_tenant_invariants(pool)


def test_while_a_tenant_is_over_its_share_the_others_evict_a_free_uncached_block_or_its_cache() -> None:
    pool = TenantBlockPool(11, share=0.2)
    cached_by(pool, "alice", 2)
    cached_by(pool, "bob", 4)
    held = pool.get_new_blocks(4, "alice")  # the uncached head: 7, 8, 9, 10
    pool.free_blocks(held[1:2])
    assert [b.block_id for b in pool.free_block_queue] == [1, 2, 3, 4, 5, 6, 8]

    # Alice's own block 1 is at the head, but bob is over his share: a free uncached block first,
    assert [b.block_id for b in pool.get_new_blocks(1, "alice")] == [8]
    # then bob's least recently used cached blocks, until he is within his share again,
    assert [b.block_id for b in pool.get_new_blocks(2, "alice")] == [3, 4]
    assert pool.tenants_over_share() == []
    # and then the head, as in a plain pool.
    assert [b.block_id for b in pool.get_new_blocks(1, "alice")] == [1]
    assert_tenant_invariants(pool)


def test_a_tenant_within_its_share_takes_the_free_queue_head_as_a_plain_pool_does() -> None:
    pool = TenantBlockPool(11, share=0.5)
    cached_by(pool, "alice", 2)

    assert [b.block_id for b in pool.get_new_blocks(9, "bob")] == [3, 4, 5, 6, 7, 8, 9, 10, 1]


def workload(tenants: tuple[str | None, ...]) -> list[Request]:
    """Requests that share prefixes and overflow the pool, of ``tenants`` in turn (unsalted)."""
    requests = []
    for i in range(40):
        prompt = [*PREFIX[: 4 * (i % 3)], *(2000 + 8 * i + j for j in range(6 + i % 7))]
        params = SamplingParams(max_tokens=1 + i % 5, ignore_eos=True)
        requests.append(Request(f"r{i}", prompt, params, tenant=tenants[i % len(tenants)]))
    return requests


def block_trace(scheduler: Scheduler, requests: list[Request]) -> list[tuple]:
    """Every plan's block ids, then the free queue's order."""
    plans = []
    for start in range(0, len(requests), 8):  # arrivals in waves, so that requests preempt and evict
        plans += run(scheduler, *requests[start : start + 8])
    pool = scheduler.kv_cache_manager.block_pool
    return [(p.req_ids, p.new_block_ids, p.preempted_req_ids) for p in plans] + [
        tuple(b.block_id for b in pool.free_block_queue)
    ]


def test_without_a_share_tenants_change_nothing_and_the_pool_is_a_plain_one() -> None:
    plain = make_scheduler(None)
    assert type(plain.kv_cache_manager.block_pool) is BlockPool
    assert block_trace(plain, workload((None,))) == block_trace(make_scheduler(None), workload(("a", "b")))


def test_with_a_share_requests_without_a_tenant_are_served_as_without_one() -> None:
    assert block_trace(make_scheduler(None), workload((None,))) == block_trace(make_scheduler(0.1), workload((None,)))


def test_a_failed_step_takes_its_blocks_out_of_their_tenant_s_count() -> None:
    scheduler = make_scheduler(0.5)
    pool = scheduler.kv_cache_manager.block_pool
    run(scheduler, tenant_request("alice-1", [*PREFIX, 1, 2], "alice"))
    scheduler.add_request(tenant_request("bob-1", list(range(500, 500 + 3 * BLOCK_SIZE)), "bob"))
    scheduler.add_request(tenant_request("alice-2", [*PREFIX, *range(600, 600 + 2 * BLOCK_SIZE)], "alice"))
    plan = scheduler.schedule()
    assert pool.cached_blocks_by_tenant() == {"alice": 6, "bob": 3}

    scheduler.discard_step(plan)

    # Only alice's first request's blocks were written: her prefix, hit again by the failed step, stays.
    assert pool.cached_blocks_by_tenant() == {"alice": 4}
    assert_tenant_invariants(pool)
    assert pool.reset_prefix_cache() and pool.cached_blocks_by_tenant() == {}
    assert_tenant_invariants(pool)


def test_the_share_is_a_cache_setting_checked_where_it_is_given() -> None:
    config = EngineConfig.from_kwargs("m", tenant_cache_share=0.25).cache_config(num_blocks=41, model_id="m")
    assert config.tenant_cache_share == 0.25
    assert isinstance(Scheduler(SchedulerConfig(), config).kv_cache_manager.block_pool, TenantBlockPool)
    assert EngineConfig.default("tenant_cache_share") is None
    for bad in (0, 0.0, 1.5, -0.1, True, "0.5", float("nan")):
        with pytest.raises(ValueError, match="tenant_cache_share"):
            CacheConfig(tenant_cache_share=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="tenant_cache_share"):
            EngineConfig.from_kwargs("m", tenant_cache_share=bad)
    # Without prefix caching there is nothing to share.
    config = CacheConfig(enable_prefix_caching=False, tenant_cache_share=0.5)
    assert type(Scheduler(SchedulerConfig(), config).kv_cache_manager.block_pool) is BlockPool
