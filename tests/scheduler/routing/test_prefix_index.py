"""The global prefix index: exact against brute-force scans of real pools, one walk per match."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.scheduler.block_hash import BlockHash
from kvserve.scheduler.block_pool import BlockPool
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.kv_cache_block import KVCacheBlock
from kvserve.scheduler.request import Request
from kvserve.scheduler.routing.prefix_index import GlobalPrefixIndex
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler

# A small alphabet, so that one hash is often cached by several blocks and replicas.
HASHES: list[BlockHash] = [bytes([i + 1]) * 16 for i in range(5)]
NUM_REPLICAS = 3

OPERATIONS = st.lists(
    st.one_of(
        # allocate n blocks on a replica and cache them under these hashes
        st.tuples(st.just("store"), st.integers(0, NUM_REPLICAS - 1), st.lists(st.sampled_from(HASHES), min_size=1, max_size=4)),
        # free the k-th held allocation of a replica (its blocks become evictable)
        st.tuples(st.just("free"), st.integers(0, NUM_REPLICAS - 1), st.integers(0, 100)),
        # allocate blocks without caching them: evicts from the LRU head
        st.tuples(st.just("allocate"), st.integers(0, NUM_REPLICAS - 1), st.integers(1, 4)),
        st.tuples(st.just("reset"), st.integers(0, NUM_REPLICAS - 1), st.just(0)),
    ),
    max_size=40,
)


def brute_force_copies(pool: BlockPool) -> Counter[BlockHash]:
    return Counter(block_hash for block_hash, blocks in pool.cached_block_hash_to_block.items() for _ in blocks)


def brute_force_match(pools: list[BlockPool], block_hashes: list[BlockHash]) -> dict[int, int]:
    matched = {}
    for replica_id, pool in enumerate(pools):
        count = 0
        for block_hash in block_hashes:
            if pool.get_cached_block(block_hash) is None:
                break
            count += 1
        if count:
            matched[replica_id] = count
    return matched


@settings(max_examples=200, deadline=None)
@given(operations=OPERATIONS, queries=st.lists(st.lists(st.sampled_from(HASHES), min_size=1, max_size=5), min_size=1, max_size=5))
def test_index_equals_a_brute_force_scan_of_the_pools_under_random_store_and_evict(
    operations: list[tuple], queries: list[list[BlockHash]]
) -> None:
    index = GlobalPrefixIndex()
    pools = [BlockPool(8, observer=index.observer_for(r)) for r in range(NUM_REPLICAS)]
    held: list[list[list[KVCacheBlock]]] = [[] for _ in range(NUM_REPLICAS)]
    for kind, replica_id, arg in operations:
        pool = pools[replica_id]
        if kind == "store" and pool.get_num_free_blocks() >= len(arg):
            blocks = pool.get_new_blocks(len(arg))
            pool.cache_full_blocks(blocks, arg, 0, len(arg))
            held[replica_id].append(blocks)
        elif kind == "allocate" and pool.get_num_free_blocks() >= arg:
            held[replica_id].append(pool.get_new_blocks(arg))
        elif kind == "free" and held[replica_id]:
            blocks = held[replica_id].pop(arg % len(held[replica_id]))
            pool.free_blocks(reversed(blocks))
        elif kind == "reset":
            pool.reset_prefix_cache()  # refuses (and sends nothing) while blocks are held

        for r, p in enumerate(pools):
            copies = brute_force_copies(p)
            assert {h: index.num_copies(r, h) for h in HASHES if index.num_copies(r, h)} == dict(copies)
            assert index.num_blocks(r) == len(copies)
        for block_hash in HASHES:
            expected = {r for r, p in enumerate(pools) if p.get_cached_block(block_hash) is not None}
            assert index.replicas_holding(block_hash) == expected
    for query in queries:
        assert index.match(query) == brute_force_match(pools, query)


def test_removing_one_of_two_copies_keeps_the_replica_in_the_index() -> None:
    index = GlobalPrefixIndex()
    observer = index.observer_for(0)
    observer.blocks_stored([HASHES[0], HASHES[0]], [1, 2])

    observer.blocks_removed([HASHES[0]], [1])

    assert index.replicas_holding(HASHES[0]) == {0}
    observer.blocks_removed([HASHES[0]], [2])
    assert index.replicas_holding(HASHES[0]) == frozenset()
    assert len(index) == 0


def test_match_counts_leading_blocks_for_every_replica_in_one_walk() -> None:
    h0, h1, h2, h3 = HASHES[:4]
    index = GlobalPrefixIndex()
    index.add_blocks(0, [h0, h1])
    index.add_blocks(1, [h0])
    index.add_blocks(2, [h0, h1, h2])
    index.add_blocks(5, [h2])  # holds h2 but not the blocks before it: no match

    assert index.match([h0, h1, h2, h3]) == {0: 2, 1: 1, 2: 3}


def test_match_stops_walking_when_no_candidate_is_left() -> None:
    index = GlobalPrefixIndex()
    chain = [bytes([0, i % 256, i // 256]) + bytes(13) for i in range(1000)]
    index.add_blocks(0, chain[:3])
    index.add_blocks(1, chain)  # only replica 1 holds the rest, but it lacks nothing
    index.add_blocks(2, chain[:2])

    class CountingDict(dict):
        lookups = 0

        def get(self, key, default=None):
            CountingDict.lookups += 1
            return super().get(key, default)

    index._holders = CountingDict(index._holders)
    assert index.match(chain[:3] + [HASHES[0]] + chain[4:]) == {0: 3, 1: 3, 2: 2}
    assert CountingDict.lookups == 4  # blocks 0..3, then every candidate is gone


@pytest.mark.parametrize("num_replicas", [3, 9, 200])  # few holders, more than 8 (a dense mask), many words
def test_match_agrees_with_a_scan_of_every_replica_whatever_their_ids(num_replicas: int) -> None:
    rng = random.Random(num_replicas)
    chain = [bytes([1, i % 256, i // 256]) + bytes(13) for i in range(50)]
    ids = rng.sample(range(1100), num_replicas)  # ids far beyond one machine word
    held = {replica_id: [h for h in chain if rng.random() < 0.95] for replica_id in ids}
    index = GlobalPrefixIndex()
    for replica_id, hashes in held.items():
        index.add_blocks(replica_id, hashes)
    expected = {}
    for replica_id, hashes in held.items():
        count = next((i for i, h in enumerate(chain) if h not in hashes), len(chain))
        if count:
            expected[replica_id] = count

    assert index.match(chain) == expected
    assert index.replicas_holding(chain[0]) == {r for r, hashes in held.items() if chain[0] in hashes}


def test_a_new_pool_of_a_replica_starts_with_nothing_cached() -> None:
    index = GlobalPrefixIndex()
    index.observer_for(0).blocks_stored(HASHES[:2], [1, 2])
    index.add_blocks(1, HASHES[:1])

    index.observer_for(0)  # replica 0 restarted with a fresh pool, without resetting the old one

    assert index.match(HASHES[:2]) == {1: 1}
    assert index.num_blocks(0) == 0


def test_clearing_a_replica_forgets_only_its_blocks() -> None:
    index = GlobalPrefixIndex()
    index.add_blocks(0, HASHES[:2])
    index.add_blocks(1, HASHES[:1])

    index.observer_for(0).all_blocks_cleared()

    assert index.match(HASHES[:2]) == {1: 1}
    assert index.num_blocks(0) == 0


def test_a_request_never_matches_another_tenants_blocks() -> None:
    """Salted first blocks differ, so the chain of another tenant's identical prompt never matches."""
    index = GlobalPrefixIndex()
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=256, max_model_len=256),
        CacheConfig(block_size=4, num_blocks=64),
        observer=index.observer_for(0),
    )
    prompt = list(range(40))
    tenant_a = Request("a", prompt, SamplingParams(max_tokens=1), cache_salt="tenant-a")
    scheduler.add_request(tenant_a)
    plan = scheduler.schedule()
    scheduler.update(plan, [7])
    hasher = scheduler.kv_cache_manager.hasher

    assert index.match(hasher.hash_token_ids(prompt, "tenant-a")) == {0: 10}
    assert index.match(hasher.hash_token_ids(prompt, "tenant-b")) == {}
    assert index.match(hasher.hash_token_ids(prompt, None)) == {}


def test_removing_a_block_never_stored_is_an_error() -> None:
    index = GlobalPrefixIndex()

    with pytest.raises(ValueError, match="never stored"):
        index.observer_for(0).blocks_removed([HASHES[0]], [3])


def test_a_replaced_pool_no_longer_feeds_the_index() -> None:
    """A replica's new pool (``observer_for`` again) replaces the old one: the old pool's
    events, evicting a block the index forgot or resetting its cache, change nothing."""
    index = GlobalPrefixIndex()
    old_pool = BlockPool(4, observer=index.observer_for(0))
    old_blocks = old_pool.get_new_blocks(1)
    old_pool.cache_full_blocks(old_blocks, [HASHES[0]], 0, 1)
    new_pool = BlockPool(4, observer=index.observer_for(0))
    new_blocks = new_pool.get_new_blocks(1)
    new_pool.cache_full_blocks(new_blocks, [HASHES[1]], 0, 1)
    assert index.match([HASHES[0]]) == {}

    old_pool.free_blocks(old_blocks)
    old_pool.free_blocks(old_pool.get_new_blocks(3))  # evicts HASHES[0] from the old pool
    assert old_pool.reset_prefix_cache()
    assert index.match([HASHES[1]]) == {0: 1}
    assert index.num_blocks(0) == 1
