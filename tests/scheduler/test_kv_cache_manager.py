"""KVCacheManager: prefix hits, slot allocation, caching as blocks fill, freeing in reverse."""

from __future__ import annotations

import pytest

from kvserve.scheduler.kv_cache_manager import KVCacheManager
from kvserve.scheduler.request import Request

LETTERS = {c: i + 1 for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZ")}


def tokens(text: str) -> list[int]:
    return [LETTERS[c] for c in text]


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def ref_counts(manager: KVCacheManager) -> dict[int, int]:
    return {b.block_id: b.ref_cnt for b in manager.block_pool.blocks[1:]}


def schedule_prompt(manager: KVCacheManager, request: Request) -> list[int]:
    """Admit ``request`` as the scheduler does: prefix lookup, then slots for the rest."""
    computed = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(request, request.num_tokens - computed.num_tokens, computed)
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    return manager.get_block_ids(request.req_id)


def decode(manager: KVCacheManager, request: Request, token: int) -> list[int]:
    request.append_output_token(token)
    new_blocks = manager.allocate_slots(request, 1)
    assert new_blocks is not None
    request.num_computed_tokens += 1
    return [b.block_id for b in new_blocks]


def test_seed_worked_example_step_by_step() -> None:
    """The prefix-caching walk-through of the seeds, with block_size 4 and 10 blocks.

    Block 0 is the null block, so blocks 1..9 are handed out.
    """
    manager = KVCacheManager(num_blocks=10, block_size=4)
    pool = manager.block_pool

    # req0 "ABCD|EFGH|IJKL|MNO": four blocks, the three full ones are cached.
    req0 = Request("req0", tokens("ABCDEFGHIJKLMNO"))
    assert schedule_prompt(manager, req0) == [1, 2, 3, 4]
    assert [pool.blocks[i].block_hash is not None for i in (1, 2, 3, 4)] == [True, True, True, False]
    assert free_ids(manager) == [5, 6, 7, 8, 9]

    # req0 decodes "P" (block 4 becomes full and is cached), then "Q" needs block 5.
    assert decode(manager, req0, LETTERS["P"]) == []
    assert pool.blocks[4].block_hash == req0.block_hashes[3]
    assert decode(manager, req0, LETTERS["Q"]) == [5]

    # req1 shares the first 10 tokens: only two full blocks match.
    req1 = Request("req1", tokens("ABCDEFGHIJXYZW"))
    hit = manager.get_computed_blocks(req1)
    assert [b.block_id for b in hit.blocks] == [1, 2] and hit.num_tokens == 8
    assert schedule_prompt(manager, req1) == [1, 2, 6, 7]
    assert ref_counts(manager) == {1: 2, 2: 2, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1, 8: 0, 9: 0}

    # req0 finishes: its blocks go to the tail in reverse; 1 and 2 are still held.
    manager.free(req0)
    assert free_ids(manager) == [8, 9, 5, 4, 3]
    assert ref_counts(manager) == {1: 1, 2: 1, 3: 0, 4: 0, 5: 0, 6: 1, 7: 1, 8: 0, 9: 0}

    # req1 finishes.
    manager.free(req1)
    assert free_ids(manager) == [8, 9, 5, 4, 3, 7, 6, 2, 1]

    # req2 "ABCD|EFGH|IJKL|" + 5 more blocks (29 tokens): three cached blocks are
    # taken out of the middle of the queue, five new ones come from the head,
    # evicting block 4 ("MNOP") on the way.
    req2 = Request("req2", tokens("ABCDEFGHIJKL") + [30 + i for i in range(17)])
    hit = manager.get_computed_blocks(req2)
    assert [b.block_id for b in hit.blocks] == [1, 2, 3]
    block_4_hash = pool.blocks[4].block_hash
    assert pool.get_cached_block(block_4_hash) is pool.blocks[4]
    assert schedule_prompt(manager, req2) == [1, 2, 3, 8, 9, 5, 4, 7]
    assert pool.get_cached_block(block_4_hash) is None
    assert free_ids(manager) == [6]
    assert ref_counts(manager) == {1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 0, 7: 1, 8: 1, 9: 1}


def test_hit_never_covers_the_whole_prompt() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4)
    first = Request("a", list(range(1, 9)))
    schedule_prompt(manager, first)
    manager.free(first)
    again = Request("b", list(range(1, 9)))
    hit = manager.get_computed_blocks(again)
    assert hit.num_tokens == 4  # the second block holds the last token: recomputed


def test_allocate_returns_none_and_touches_nothing_when_full() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=2)
    first = Request("a", [1, 2, 3, 4])
    schedule_prompt(manager, first)
    manager.free(first)
    before_free = free_ids(manager)
    second = Request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hit = manager.get_computed_blocks(second)
    assert hit.num_tokens == 4
    assert manager.allocate_slots(second, second.num_tokens - hit.num_tokens, hit) is None
    assert free_ids(manager) == before_free
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)
    assert manager.get_block_ids("b") == []


def test_cache_hit_blocks_in_the_free_queue_count_against_free_space() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=2)
    first = Request("a", [1, 2, 3, 4, 5])
    schedule_prompt(manager, first)  # 3 blocks, 2 cached
    manager.free(first)
    second = Request("b", [1, 2, 3, 4, 5, 6, 7])
    hit = manager.get_computed_blocks(second)
    assert hit.num_tokens == 4
    # 2 more blocks needed; 3 free of which 2 are the hit itself: only 1 left.
    assert manager.allocate_slots(second, 3, hit) is None
    third = Request("c", [1, 2, 3, 4, 5, 6])
    hit = manager.get_computed_blocks(third)
    assert manager.allocate_slots(third, 2, hit) is not None


def test_chunked_allocation_caches_blocks_as_they_fill() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4)
    request = Request("a", list(range(1, 11)))
    assert len(manager.allocate_slots(request, 6)) == 2
    request.num_computed_tokens = 6
    assert manager.num_cached_blocks["a"] == 1
    assert len(manager.allocate_slots(request, 4)) == 1
    assert manager.num_cached_blocks["a"] == 2
    assert [b.block_hash for b in manager.req_to_blocks["a"][:2]] == request.block_hashes


def test_free_releases_all_blocks_last_first() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=2)
    request = Request("a", list(range(1, 8)))
    assert schedule_prompt(manager, request) == [1, 2, 3, 4]
    manager.free(request)
    assert free_ids(manager) == [5, 4, 3, 2, 1]
    assert manager.get_block_ids("a") == []


def test_salted_requests_do_not_share_blocks() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4)
    schedule_prompt(manager, Request("a", list(range(1, 13)), cache_salt="tenant-a"))
    other = Request("b", list(range(1, 13)), cache_salt="tenant-b")
    assert manager.get_computed_blocks(other).num_tokens == 0
    same = Request("c", list(range(1, 13)), cache_salt="tenant-a")
    assert manager.get_computed_blocks(same).num_tokens == 8


def test_caching_disabled_never_hits() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    first = Request("a", list(range(1, 13)))
    schedule_prompt(manager, first)
    manager.free(first)
    assert manager.get_computed_blocks(Request("b", list(range(1, 13)))).num_tokens == 0


def test_prefix_cache_stats_count_queries_and_hits() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4)
    schedule_prompt(manager, Request("a", list(range(1, 13))))
    schedule_prompt(manager, Request("b", list(range(1, 13))))
    stats = manager.prefix_cache_stats
    assert (stats.num_requests, stats.num_queried_tokens, stats.num_hit_tokens) == (2, 24, 8)
    assert stats.hit_rate == pytest.approx(8 / 24)


def test_prefix_cache_stats_count_a_request_once_however_long_it_waits_for_blocks() -> None:
    # A waiting request is looked up at every step until it gets its blocks: 2 requests of
    # 320 tokens once counted 3,520 queried tokens on a tight pool.
    manager = KVCacheManager(num_blocks=8, block_size=4)  # 7 usable
    schedule_prompt(manager, Request("a", list(range(1, 13))))  # 3 blocks
    blocker = Request("c", list(range(40, 56)))  # the other 4
    schedule_prompt(manager, blocker)
    waiting = Request("b", list(range(1, 13)) + list(range(20, 32)))  # a's 3 blocks, then 3 more
    for _ in range(3):  # no room: nothing counted
        computed = manager.get_computed_blocks(waiting)
        assert manager.allocate_slots(waiting, waiting.num_tokens - computed.num_tokens, computed) is None
    stats = manager.prefix_cache_stats
    assert (stats.num_requests, stats.num_queried_tokens, stats.num_hit_tokens) == (2, 28, 0)
    manager.free(blocker)
    computed = manager.get_computed_blocks(waiting)
    assert manager.allocate_slots(waiting, waiting.num_tokens - computed.num_tokens, computed) is not None
    assert (stats.num_requests, stats.num_queried_tokens, stats.num_hit_tokens) == (3, 52, 12)


def test_negative_token_count_is_rejected() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=2)
    with pytest.raises(ValueError):
        manager.allocate_slots(Request("a", [1]), -1)


@pytest.mark.parametrize("enable_caching", [True, False])
def test_kv_room_is_where_the_next_decode_needs_a_block_or_fills_one(enable_caching: bool) -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_caching=enable_caching)
    request = Request("r", tokens("ABCDEF"))
    assert request.kv_room == 0
    schedule_prompt(manager, request)  # 6 tokens: block 0 full, block 1 half
    # With caching, holding 7 tokens is free; the 8th fills block 1, which must be cached.
    assert request.kv_room == (7 if enable_caching else 8)
    num_cached_before = len(manager.block_pool.cached_block_hash_to_block)
    for token in tokens("GHIJ"):
        # The scheduler skips the call while num_computed_tokens < kv_room; below
        # that line the call would allocate nothing, and it does not.
        skippable = request.num_computed_tokens < request.kv_room
        new_blocks = decode(manager, request, token)
        if skippable:
            assert new_blocks == []
            assert len(manager.block_pool.cached_block_hash_to_block) == num_cached_before
        assert request.num_computed_tokens <= request.kv_room
        num_cached_before = len(manager.block_pool.cached_block_hash_to_block)
    assert len(manager.get_block_ids("r")) == 3  # 10 tokens
    if enable_caching:
        assert len(manager.block_pool.cached_block_hash_to_block) == 2
    manager.free(request)
    assert request.kv_room == 0
