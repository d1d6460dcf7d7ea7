"""BlockPool invariants under random allocations, frees, cache hits, caching and resets.

A hypothesis state machine drives one small pool directly and holds block
references the way requests do (a multiset: a block hit by several requests is
held several times).  Hashes come from a four-value alphabet, so one hash
often maps to several blocks.  After every rule the pool's bookkeeping must
agree with the references held and with the prefix-cache index an observer
rebuilt from the pool's events alone.

The helpers at the top (``assert_pool_invariants``, ``CacheIndexObserver``)
are shared with the KV-cache manager and scheduler state machines.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.scheduler.block_hash import BlockHash
from kvserve.scheduler.block_pool import BlockPool
from kvserve.scheduler.kv_cache_block import FreeKVCacheBlockQueue, KVCacheBlock

# A tiny alphabet of 16-byte hashes: several blocks under one hash are the point.
HASHES: list[BlockHash] = [bytes([i + 1]) * 16 for i in range(3)]


# -- shared checks -------------------------------------------------------------


def walk_free_queue(queue: FreeKVCacheBlockQueue, max_len: int) -> list[KVCacheBlock]:
    """The free blocks from head to tail by the forward links, checking every backward link."""
    blocks: list[KVCacheBlock] = []
    prev = queue.fake_head
    block = prev.next_free_block
    while block is not queue.fake_tail:
        assert block is not None, "the forward links end before fake_tail"
        assert block.prev_free_block is prev, f"block {block.block_id}'s backward link disagrees"
        blocks.append(block)
        assert len(blocks) <= max_len, "the free queue has a cycle or more blocks than the pool"
        prev, block = block, block.next_free_block
    assert queue.fake_tail.prev_free_block is prev, "fake_tail's backward link disagrees"
    return blocks


def free_block_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in walk_free_queue(pool.free_block_queue, pool.num_blocks)]


def cached_pairs(pool: BlockPool) -> set[tuple[BlockHash, int]]:
    """The (hash, block id) pairs held by the pool's hash map."""
    return {
        (block_hash, block.block_id)
        for block_hash, blocks in pool.cached_block_hash_to_block.items()
        for block in blocks
    }


def assert_pool_invariants(pool: BlockPool, ref_counts: Mapping[int, int]) -> None:
    """Every structural invariant of ``pool``; ``ref_counts`` maps block id -> references held."""
    null = pool.null_block
    assert null is pool.blocks[0] and null.block_id == 0 and null.is_null
    assert null.ref_cnt == 0 and null.block_hash is None
    assert null.prev_free_block is None and null.next_free_block is None
    assert ref_counts.get(0, 0) == 0, "the null block was handed out"
    assert [block.block_id for block in pool.blocks] == list(range(pool.num_blocks))

    free = walk_free_queue(pool.free_block_queue, pool.num_blocks)
    free_ids = [block.block_id for block in free]
    assert len(set(free_ids)) == len(free_ids), f"a block is twice in the free queue: {free_ids}"
    assert all(block is pool.blocks[block.block_id] for block in free)
    assert pool.get_num_free_blocks() == len(free) == len(pool.free_block_queue.get_all_free_blocks())
    assert pool.free_block_queue.get_all_free_blocks() == free

    # Each block is exactly one of: null, free (in the queue), referenced (not in it).
    in_queue = set(free_ids)
    for block in pool.blocks[1:]:
        assert not block.is_null
        assert block.ref_cnt >= 0
        assert block.ref_cnt == ref_counts.get(block.block_id, 0), (
            f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
            f"held {ref_counts.get(block.block_id, 0)} times"
        )
        if block.ref_cnt == 0:
            assert block.block_id in in_queue, f"free block {block.block_id} is not in the free queue"
        else:
            assert block.block_id not in in_queue, f"referenced block {block.block_id} is in the queue"
            assert block.prev_free_block is None and block.next_free_block is None

    num_referenced = sum(1 for block in pool.blocks[1:] if block.ref_cnt > 0)
    assert num_referenced + len(free) == pool.num_blocks - 1
    # NOTE: isclose, not ==: get_usage computes 1 - free/usable, which can differ
    # from referenced/usable in the last bit (1 - 1/3 != 2/3 in binary floating point).
    assert math.isclose(pool.get_usage(), num_referenced / (pool.num_blocks - 1), abs_tol=1e-12)

    # The hash map and the hashes the blocks carry describe the same cache.
    for block_hash, blocks in pool.cached_block_hash_to_block.items():
        assert blocks, "a hash maps to no block"
        assert len({block.block_id for block in blocks}) == len(blocks)
        for block in blocks:
            assert block is pool.blocks[block.block_id]
            assert block.block_hash == block_hash
        assert pool.get_cached_block(block_hash) in blocks
    carried = {(block.block_hash, block.block_id) for block in pool.blocks if block.block_hash is not None}
    assert cached_pairs(pool) == carried


class CacheIndexObserver:
    """Rebuilds the pool's (hash, block id) cache entries from its events alone, as a router would."""

    def __init__(self) -> None:
        self.pairs: set[tuple[BlockHash, int]] = set()

    def blocks_stored(self, block_hashes: list[BlockHash], block_ids: list[int]) -> None:
        assert len(block_hashes) == len(block_ids)
        for pair in zip(block_hashes, block_ids):
            assert pair not in self.pairs, f"stored twice without removal: {pair}"
            self.pairs.add(pair)

    def blocks_removed(self, block_hashes: list[BlockHash], block_ids: list[int]) -> None:
        assert len(block_hashes) == len(block_ids)
        for pair in zip(block_hashes, block_ids):
            assert pair in self.pairs, f"removed without being stored: {pair}"
            self.pairs.remove(pair)

    def all_blocks_cleared(self) -> None:
        self.pairs.clear()


def test_a_rejected_over_free_leaves_the_pool_unchanged() -> None:
    """``free_blocks`` that raises for an over-freed block changes nothing.

    Block 1 is held once and block 2 is already free: freeing [1, 2] raises,
    and block 1 must still be held once.  (A partial free that drops block 1 to
    no reference without queueing it loses the block to the pool for good.)
    """
    pool = BlockPool(3)
    held, already_free = pool.get_new_blocks(2)
    pool.free_blocks([already_free])

    with pytest.raises(ValueError):
        pool.free_blocks([held, already_free])

    assert_pool_invariants(pool, {held.block_id: 1})


# -- the state machine -----------------------------------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    """Drives one BlockPool; ``held`` is the multiset of block references the machine owns."""

    @initialize(num_blocks=st.integers(2, 12))
    def create_pool(self, num_blocks: int) -> None:
        self.observer = CacheIndexObserver()
        self.pool = BlockPool(num_blocks, observer=self.observer)
        self.held: Counter[int] = Counter()

    @rule(num_blocks=st.integers(0, 13))
    def get_new_blocks(self, num_blocks: int) -> None:
        free_before = free_block_ids(self.pool)
        if num_blocks > len(free_before):
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(num_blocks)
            assert free_block_ids(self.pool) == free_before
            return
        blocks = self.pool.get_new_blocks(num_blocks)
        # The least recently freed blocks go first, and lose their cache entries.
        assert [block.block_id for block in blocks] == free_before[:num_blocks]
        assert all(block.ref_cnt == 1 and block.block_hash is None for block in blocks)
        self.held.update(block.block_id for block in blocks)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), with_null_block=st.booleans())
    def free_some_references(self, data: st.DataObject, with_null_block: bool) -> None:
        order = data.draw(st.permutations(sorted(self.held.elements())), label="order")
        num_freed = data.draw(st.integers(1, len(order)), label="num_freed")
        block_ids = order[:num_freed]
        if with_null_block:
            # Freeing the null block (table padding) must be a no-op.
            block_ids = [*block_ids[:1], 0, *block_ids[1:]]
        free_before = free_block_ids(self.pool)

        self.pool.free_blocks([self.pool.blocks[i] for i in block_ids])

        # Blocks whose last reference went join the tail, in the order that happened.
        newly_free = []
        for block_id in block_ids:
            if block_id == 0:
                continue
            self.held[block_id] -= 1
            if self.held[block_id] == 0:
                del self.held[block_id]
                newly_free.append(block_id)
        assert free_block_ids(self.pool) == free_before + newly_free

    @rule(block_hash=st.sampled_from(HASHES))
    def touch_cache_hit(self, block_hash: BlockHash) -> None:
        block = self.pool.get_cached_block(block_hash)
        carriers = [b for b in self.pool.blocks if b.block_hash == block_hash]
        if block is None:
            assert carriers == []
            return
        assert any(block is carrier for carrier in carriers)
        free_before = free_block_ids(self.pool)

        self.pool.touch([block])

        self.held[block.block_id] += 1
        assert block.block_hash == block_hash, "a cache hit must keep the block cached"
        assert free_block_ids(self.pool) == [i for i in free_before if i != block.block_id]

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def cache_held_blocks(self, data: st.DataObject) -> None:
        block_ids = data.draw(
            st.lists(st.sampled_from(sorted(self.held)), min_size=1, max_size=6, unique=True),
            label="block_ids",
        )
        hashes = data.draw(
            st.lists(st.sampled_from(HASHES), min_size=len(block_ids), max_size=len(block_ids)),
            label="hashes",
        )
        num_cached = data.draw(st.integers(0, len(block_ids)), label="num_cached")
        blocks = [self.pool.blocks[i] for i in block_ids]
        hashes_before = [block.block_hash for block in blocks]

        self.pool.cache_full_blocks(blocks, hashes, num_cached, len(blocks))

        for i, block in enumerate(blocks):
            if i < num_cached or hashes_before[i] is not None:
                # Already cached (or outside the range): left alone, never re-hashed.
                assert block.block_hash == hashes_before[i]
            else:
                assert block.block_hash == hashes[i]
                assert any(b is block for b in self.pool.cached_block_hash_to_block.get_all_blocks(hashes[i]))

    @rule()
    def reset_prefix_cache(self) -> None:
        hashes_before = [block.block_hash for block in self.pool.blocks]
        free_before = free_block_ids(self.pool)

        reset = self.pool.reset_prefix_cache()

        assert reset == (not self.held)
        if reset:
            assert all(block.block_hash is None for block in self.pool.blocks)
            assert len(self.pool.cached_block_hash_to_block) == 0
        else:
            assert [block.block_hash for block in self.pool.blocks] == hashes_before
        assert free_block_ids(self.pool) == free_before

    @invariant()
    def pool_is_consistent(self) -> None:
        assert_pool_invariants(self.pool, self.held)

    @invariant()
    def observer_index_matches_the_hash_map(self) -> None:
        assert self.observer.pairs == cached_pairs(self.pool)

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.free_blocks([self.pool.blocks[i] for i in sorted(self.held.elements())])
        self.held.clear()
        assert_pool_invariants(self.pool, self.held)
        assert self.pool.get_num_free_blocks() == self.pool.num_blocks - 1
        assert self.pool.get_usage() == 0.0
        assert self.pool.reset_prefix_cache()
        assert self.observer.pairs == set()


BlockPoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestBlockPoolStateMachine = BlockPoolMachine.TestCase
