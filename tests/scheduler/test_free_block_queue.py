"""The LRU free queue: O(1) operations on an intrusive doubly linked list."""

from __future__ import annotations

import pytest

from kvserve.scheduler.kv_cache_block import FreeKVCacheBlockQueue, KVCacheBlock


def ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [block.block_id for block in queue.get_all_free_blocks()]


@pytest.fixture
def blocks() -> list[KVCacheBlock]:
    return [KVCacheBlock(i) for i in range(6)]


def test_initial_order_is_the_given_order(blocks: list[KVCacheBlock]) -> None:
    queue = FreeKVCacheBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3, 4, 5]
    assert len(queue) == 6


def test_popleft_takes_the_head(blocks: list[KVCacheBlock]) -> None:
    queue = FreeKVCacheBlockQueue(blocks)
    block = queue.popleft()
    assert block.block_id == 0
    assert block.prev_free_block is None and block.next_free_block is None
    assert ids(queue) == [1, 2, 3, 4, 5]


def test_popleft_n_takes_the_n_oldest_in_order(blocks: list[KVCacheBlock]) -> None:
    queue = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in queue.popleft_n(3)] == [0, 1, 2]
    assert ids(queue) == [3, 4, 5]
    assert queue.num_free_blocks == 3
    assert queue.popleft_n(0) == []


def test_popleft_n_more_than_free_raises(blocks: list[KVCacheBlock]) -> None:
    queue = FreeKVCacheBlockQueue(blocks[:2])
    with pytest.raises(ValueError):
        queue.popleft_n(3)
    assert ids(queue) == [0, 1]


def test_popleft_on_empty_queue_raises() -> None:
    with pytest.raises(ValueError):
        FreeKVCacheBlockQueue([]).popleft()


def test_remove_from_the_middle_relinks_neighbours(blocks: list[KVCacheBlock]) -> None:
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4, 5]
    assert blocks[1].next_free_block is blocks[3]
    assert blocks[3].prev_free_block is blocks[1]
    with pytest.raises(ValueError):
        queue.remove(blocks[2])


def test_append_and_append_n_go_to_the_tail(blocks: list[KVCacheBlock]) -> None:
    queue = FreeKVCacheBlockQueue(blocks[:2])
    queue.append(blocks[4])
    queue.append_n([blocks[3], blocks[2]])
    assert ids(queue) == [0, 1, 4, 3, 2]
    assert len(queue) == 5
    backwards = []
    block = queue.fake_tail.prev_free_block
    while block is not queue.fake_head:
        backwards.append(block.block_id)
        block = block.prev_free_block
    assert backwards == [2, 3, 4, 1, 0]
