"""BlockPool: allocation, references, the free queue and the prefix cache."""

from __future__ import annotations

import pytest

from kvserve.scheduler.block_pool import BlockPool


class RecordingObserver:
    def __init__(self) -> None:
        self.events: list[tuple[str, list[bytes], list[int]]] = []

    def blocks_stored(self, block_hashes: list[bytes], block_ids: list[int]) -> None:
        self.events.append(("stored", block_hashes, block_ids))

    def blocks_removed(self, block_hashes: list[bytes], block_ids: list[int]) -> None:
        self.events.append(("removed", block_hashes, block_ids))

    def all_blocks_cleared(self) -> None:
        self.events.append(("cleared", [], []))


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


H1, H2, H3 = b"1" * 16, b"2" * 16, b"3" * 16


def test_null_block_is_block_zero_and_never_handed_out() -> None:
    pool = BlockPool(4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 3
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_freeing_the_null_block_does_nothing() -> None:
    pool = BlockPool(3)
    pool.free_blocks([pool.null_block])
    assert pool.get_num_free_blocks() == 2
    assert free_ids(pool) == [1, 2]


def test_too_few_blocks_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


def test_get_new_blocks_sets_one_reference_and_updates_usage() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert pool.get_usage() == pytest.approx(0.5)
    assert free_ids(pool) == [3, 4]


def test_free_blocks_appends_in_the_given_order() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 3, 2, 1]
    assert all(b.ref_cnt == 0 for b in blocks)


def test_shared_block_is_freed_only_with_its_last_reference() -> None:
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and 1 not in free_ids(pool)
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and free_ids(pool)[-1] == 1


def test_double_free_raises() -> None:
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([block])


def test_cached_block_is_found_by_hash_and_survives_free() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [H1, H2], 0, 2)
    pool.free_blocks(blocks)
    assert pool.get_cached_block(H1) is blocks[0]
    assert pool.get_cached_block(H2) is blocks[1]
    assert pool.get_cached_block(H3) is None


def test_touch_takes_a_free_cached_block_out_of_the_queue() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [H1, H2, H3], 0, 3)
    pool.free_blocks(blocks)
    pool.touch([pool.get_cached_block(H2)])
    assert free_ids(pool) == [1, 3]
    assert blocks[1].ref_cnt == 1
    assert pool.get_num_free_blocks() == 2


def test_allocation_evicts_cached_blocks_from_the_head() -> None:
    observer = RecordingObserver()
    pool = BlockPool(3, observer=observer)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [H1, H2], 0, 2)
    pool.free_blocks(blocks)
    (evicted,) = pool.get_new_blocks(1)
    assert evicted.block_id == 1 and evicted.block_hash is None
    assert pool.get_cached_block(H1) is None
    assert pool.get_cached_block(H2) is blocks[1]
    assert observer.events == [("stored", [H1, H2], [1, 2]), ("removed", [H1], [1])]


def test_one_hash_can_map_to_several_blocks() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [H1], 0, 1)
    pool.cache_full_blocks([b], [H1], 0, 1)
    assert {blk.block_id for blk in pool.cached_block_hash_to_block.get_all_blocks(H1)} == {1, 2}
    pool.free_blocks([a, b])
    pool.get_new_blocks(1)  # evicts block 1
    assert pool.get_cached_block(H1) is b


def test_cache_full_blocks_caches_only_the_new_range_and_needs_hashes() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [H1, H2, H3], 1, 2)
    assert [blk.block_hash for blk in blocks] == [None, H2, None]
    with pytest.raises(ValueError, match="block hashes"):
        pool.cache_full_blocks(blocks, [H1], 2, 3)


def test_caching_disabled_stores_nothing() -> None:
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [H1, H2], 0, 2)
    assert pool.get_cached_block(H1) is None and blocks[0].block_hash is None


def test_reset_prefix_cache_refuses_while_blocks_are_in_use() -> None:
    observer = RecordingObserver()
    pool = BlockPool(4, observer=observer)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [H1, H2], 0, 2)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(H1) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(H1) is None and blocks[0].block_hash is None
    assert observer.events[-1][0] == "cleared"


def test_negative_allocation_is_rejected() -> None:
    with pytest.raises(ValueError, match="negative"):
        BlockPool(3).get_new_blocks(-1)
