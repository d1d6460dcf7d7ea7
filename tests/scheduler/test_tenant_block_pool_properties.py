"""TenantBlockPool invariants under random operations: its per-tenant counts and free lists
always equal a recount from scratch, and the pool stays a sound BlockPool.

A hypothesis state machine drives one small pool directly (allocations by three
requesters, one without a tenant; frees, cache hits, caching, uncaching, resets), and
predicts which blocks each allocation takes.  A second test runs random scheduler
operations (arrivals of several tenants' requests, steps with preemption, aborts) on a
scheduler whose pool has a share, checking the same after every operation.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.scheduler.block_hash import BlockHash
from kvserve.scheduler.config import CacheConfig
from kvserve.scheduler.kv_cache_block import KVCacheBlock
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.tenant_block_pool import TenantBlockPool
from tests.scheduler.scheduler_operations import OPERATIONS, SHAPES, run_operations, scheduler_config
from tests.scheduler.test_block_pool_properties import (
    CacheIndexObserver,
    assert_pool_invariants,
    cached_pairs,
    walk_free_queue,
)

HASHES: list[BlockHash] = [bytes([i + 1]) * 16 for i in range(4)]
TENANTS = ("a", "b", None)


def owner_name(block: KVCacheBlock) -> str | None:
    owner = block.owner  # type: ignore[attr-defined]
    return None if owner is None else owner.name


def assert_tenant_invariants(pool: TenantBlockPool) -> None:
    """Each tenant's count, free list and over-share mark, and the list of free uncached blocks,
    against a recount from the blocks themselves."""
    recount: Counter[str] = Counter()
    for block in pool.blocks:
        name = owner_name(block)
        if block.block_hash is None:
            assert name is None, f"block {block.block_id} has an owner but no hash"
        if name is not None:
            recount[name] += 1
    assert pool.cached_blocks_by_tenant() == dict(recount)
    assert set(pool.tenants_over_share()) == {n for n, c in recount.items() if c > pool.max_cached_blocks_per_tenant}
    free = walk_free_queue(pool.free_block_queue, pool.num_blocks)
    in_lists: set[int] = set()
    for name in {*recount, *pool._tenants}:
        expected = [block.block_id for block in free if owner_name(block) == name]
        listed = pool.tenant_free_blocks(name)
        assert [block.block_id for block in listed] == expected, f"tenant {name}'s free list"
        in_lists.update(expected)
    # NOTE: a set: a free block that leaves the cache (a failed step's) joins this list's tail.
    uncached = pool.uncached_free_blocks()
    assert sorted(b.block_id for b in uncached) == sorted(b.block_id for b in free if b.block_hash is None)
    in_lists.update(block.block_id for block in uncached)
    for block in pool.blocks:
        linked = block.prev_owned_free is not None  # type: ignore[attr-defined]
        assert linked == (block.next_owned_free is not None) == (block.block_id in in_lists), (  # type: ignore[attr-defined]
            f"block {block.block_id}'s free-list links"
        )
        if linked:
            assert block.prev_owned_free.next_owned_free is block  # type: ignore[attr-defined]


def expected_new_block_ids(pool: TenantBlockPool, num_blocks: int, tenant: str | None) -> list[int]:
    """The blocks ``get_new_blocks`` must take: the module docstring's rule, step by step."""
    free = walk_free_queue(pool.free_block_queue, pool.num_blocks)
    over = pool.tenants_over_share()
    if not over:
        return [block.block_id for block in free[:num_blocks]]
    donors = [tenant, *(name for name in over if name != tenant)] if tenant in over else over
    uncached = pool.uncached_free_blocks()
    own = {name: [block for block in free if owner_name(block) == name] for name in donors}
    taken = []
    for _ in range(num_blocks):
        block = free[0]
        if block.block_hash is not None and owner_name(block) not in over:
            lru = [own[name][0] for name in donors if own[name]]
            block = uncached[0] if uncached else lru[0] if lru else block
        for blocks in (free, uncached, *own.values()):
            if block in blocks:
                blocks.remove(block)
        taken.append(block.block_id)
    return taken


class TenantBlockPoolMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 14), share=st.sampled_from([0.1, 0.25, 0.5, 1.0]))
    def create_pool(self, num_blocks: int, share: float) -> None:
        self.observer = CacheIndexObserver()
        self.pool = TenantBlockPool(num_blocks, share, observer=self.observer)
        self.held: Counter[int] = Counter()

    @rule(num_blocks=st.integers(0, 15), tenant=st.sampled_from(TENANTS))
    def get_new_blocks(self, num_blocks: int, tenant: str | None) -> None:
        if num_blocks > self.pool.get_num_free_blocks():
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(num_blocks, tenant)
            return
        expected = expected_new_block_ids(self.pool, num_blocks, tenant)
        blocks = self.pool.get_new_blocks(num_blocks, tenant)
        assert [block.block_id for block in blocks] == expected
        assert all(block.ref_cnt == 1 and block.block_hash is None and owner_name(block) is None for block in blocks)
        self.held.update(expected)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_some_references(self, data: st.DataObject) -> None:
        order = data.draw(st.permutations(sorted(self.held.elements())), label="order")
        block_ids = order[: data.draw(st.integers(1, len(order)), label="num_freed")]
        self.pool.free_blocks([self.pool.blocks[i] for i in block_ids])
        self.held.subtract(block_ids)
        self.held = +self.held

    @rule(block_hash=st.sampled_from(HASHES))
    def touch_cache_hit(self, block_hash: BlockHash) -> None:
        block = self.pool.get_cached_block(block_hash)
        if block is not None:
            owner = owner_name(block)
            self.pool.touch([block])
            self.held[block.block_id] += 1
            assert owner_name(block) == owner, "a hit keeps the block its owner's"

    @precondition(lambda self: self.held)
    @rule(data=st.data(), tenant=st.sampled_from(TENANTS))
    def cache_held_blocks(self, data: st.DataObject, tenant: str | None) -> None:
        block_ids = data.draw(
            st.lists(st.sampled_from(sorted(self.held)), min_size=1, max_size=6, unique=True), label="block_ids"
        )
        hashes = data.draw(
            st.lists(st.sampled_from(HASHES), min_size=len(block_ids), max_size=len(block_ids)), label="hashes"
        )
        blocks = [self.pool.blocks[i] for i in block_ids]
        newly = [block for block in blocks if block.block_hash is None]
        self.pool.cache_full_blocks(blocks, hashes, 0, len(blocks), tenant)
        assert all(owner_name(block) == tenant for block in newly)

    @rule(data=st.data())
    def uncache_some_blocks(self, data: st.DataObject) -> None:
        # A failed step's blocks (held, or freed by its aborted requests) leave the cache.
        block_ids = data.draw(st.lists(st.integers(1, self.pool.num_blocks - 1), max_size=4, unique=True))
        self.pool.uncache_blocks([self.pool.blocks[i] for i in block_ids])
        assert all(self.pool.blocks[i].block_hash is None and owner_name(self.pool.blocks[i]) is None for i in block_ids)

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.pool.reset_prefix_cache() == (not self.held)
        if not self.held:
            assert self.pool.cached_blocks_by_tenant() == {}

    @invariant()
    def pool_is_consistent(self) -> None:
        assert_pool_invariants(self.pool, self.held)
        assert_tenant_invariants(self.pool)
        assert self.observer.pairs == cached_pairs(self.pool)

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.free_blocks([self.pool.blocks[i] for i in sorted(self.held.elements())])
        self.held.clear()
        assert_tenant_invariants(self.pool)
        assert self.pool.reset_prefix_cache()
        assert_tenant_invariants(self.pool)


TenantBlockPoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestTenantBlockPoolStateMachine = TenantBlockPoolMachine.TestCase


@settings(max_examples=100, deadline=None)
@given(operations=OPERATIONS, share=st.sampled_from([0.1, 0.3]), **SHAPES)
def test_scheduler_keeps_tenant_counts_exact_through_preemption_and_aborts(
    operations: list[tuple], share: float, budget: int, max_num_seqs: int, num_blocks: int, chunk: int | None
) -> None:
    scheduler = Scheduler(
        scheduler_config(budget, max_num_seqs, chunk),
        CacheConfig(block_size=4, num_blocks=num_blocks, tenant_cache_share=share),
    )
    pool = scheduler.kv_cache_manager.block_pool
    assert isinstance(pool, TenantBlockPool)

    def check(plan: StepPlan | None) -> None:
        assert_tenant_invariants(pool)

    # NOTE: unsalted prompts, so that one tenant's request may hit another's blocks: the owner stays.
    run_operations(scheduler, operations, check, tenants=("a", "b", None, "a"))
    scheduler.abort_requests(list(scheduler.requests))
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    assert_tenant_invariants(pool)
    assert pool.reset_prefix_cache() and pool.cached_blocks_by_tenant() == {}
