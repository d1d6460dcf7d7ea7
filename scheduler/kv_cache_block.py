"""KV-cache blocks and the doubly linked LRU queue of free blocks.

::

    fake_head <-> b7 <-> b8 <-> b9 <-> b4 <-> ... <-> fake_tail
                  ^ evicted first (LRU)               ^ freed last

A block is *free* when no request references it (``ref_cnt == 0``).  A free
block may still carry a hash: its KV is a prefix-cache entry that can be hit
(and then taken out of the middle of the queue) until it is evicted from the
head by an allocation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvserve.scheduler.block_hash import BlockHash


class KVCacheBlock:
    """Metadata of one KV-cache block: its id, references, hash and queue links."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # The hash of the full block's content and prefix; None until cached.
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        digest = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={digest}, null={self.is_null})"


class FreeKVCacheBlockQueue:
    """The free blocks in eviction order, as an intrusive doubly linked list.

    Every operation is O(1) per block, including removal from the middle (a
    cache hit on a free block).  Two sentinel blocks bound the list so that no
    operation needs a None check on its neighbours.
    """

    __slots__ = ("num_free_blocks", "fake_head", "fake_tail")

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        self.fake_head.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = self.fake_head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the least recently freed block."""
        block = self.fake_head.next_free_block
        if block is self.fake_tail or block is None:
            raise ValueError("no free blocks left")
        nxt = block.next_free_block
        self.fake_head.next_free_block = nxt
        nxt.prev_free_block = self.fake_head  # type: ignore[union-attr]
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the ``n`` least recently freed blocks, oldest first."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: only {self.num_free_blocks} are free")
        if n <= 0:
            return []
        head = self.fake_head
        blocks: list[KVCacheBlock] = []
        append = blocks.append
        block = head.next_free_block
        for _ in range(n):
            append(block)  # type: ignore[arg-type]
            nxt = block.next_free_block  # type: ignore[union-attr]
            block.prev_free_block = block.next_free_block = None  # type: ignore[union-attr]
            block = nxt
        head.next_free_block = block
        block.prev_free_block = head  # type: ignore[union-attr]
        self.num_free_blocks -= n
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail: it will be evicted last."""
        tail = self.fake_tail
        last = tail.prev_free_block
        last.next_free_block = block  # type: ignore[union-attr]
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Append ``blocks`` to the tail in the given order."""
        tail = self.fake_tail
        last = tail.prev_free_block
        count = 0
        for block in blocks:
            last.next_free_block = block  # type: ignore[union-attr]
            block.prev_free_block = last
            last = block
            count += 1
        last.next_free_block = tail  # type: ignore[union-attr]
        tail.prev_free_block = last
        self.num_free_blocks += count

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self.fake_head.next_free_block
        while block is not self.fake_tail:
            yield block  # type: ignore[misc]
            block = block.next_free_block  # type: ignore[union-attr]

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, from the head (next to evict) to the tail."""
        return list(self)
