"""The pool of KV-cache blocks of one replica, with its prefix cache.

Every GPU of a replica uses the same block ids, so one ``BlockPool`` addresses
the whole replica.  Block 0 is the *null block*: it is never handed out, never
freed and never cached (it pads block tables).

A block is always exactly one of:

* the null block;
* *referenced* (``ref_cnt > 0``), by one or more requests;
* *free* (``ref_cnt == 0``) and in the LRU free queue, cached (it has a hash
  and is in the hash map) or not.

Allocation takes free blocks from the queue head, evicting their cache
entries.  A cache hit ``touch``-es a block: one more reference, and out of the
free queue if it was there.  Freeing appends blocks whose count reaches zero to
the queue tail.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Protocol

from kvserve.scheduler.block_hash import BlockHash
from kvserve.scheduler.checks import check_num_blocks
from kvserve.scheduler.kv_cache_block import FreeKVCacheBlockQueue, KVCacheBlock

logger = logging.getLogger(__name__)


class KVCacheEventObserver(Protocol):
    """Receives the pool's prefix-cache changes (the router's global index does).

    Events come in batches, in the order they happened; the two lists of one
    call are parallel.
    """

    def blocks_stored(self, block_hashes: list[BlockHash], block_ids: list[int]) -> None: ...

    def blocks_removed(self, block_hashes: list[BlockHash], block_ids: list[int]) -> None: ...

    def all_blocks_cleared(self) -> None: ...


class BlockHashToBlockMap:
    """Block hash -> cached blocks with that hash.

    Two requests that compute the same block at once (neither hit the cache)
    both cache it, so one hash can map to several blocks.  The common single
    block is stored bare; a dict keyed by block id holds several.
    """

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def __len__(self) -> int:
        return len(self._cache)

    def get_one_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        blocks = self._cache.get(block_hash)
        if blocks is None or isinstance(blocks, KVCacheBlock):
            return blocks
        return next(iter(blocks.values()))

    def get_all_blocks(self, block_hash: BlockHash) -> list[KVCacheBlock]:
        blocks = self._cache.get(block_hash)
        if blocks is None:
            return []
        if isinstance(blocks, KVCacheBlock):
            return [blocks]
        return list(blocks.values())

    def insert(self, block_hash: BlockHash, block: KVCacheBlock) -> None:
        existing = self._cache.get(block_hash)
        if existing is None:
            self._cache[block_hash] = block
        elif isinstance(existing, KVCacheBlock):
            self._cache[block_hash] = {existing.block_id: existing, block.block_id: block}
        else:
            existing[block.block_id] = block

    def pop(self, block_hash: BlockHash, block_id: int) -> KVCacheBlock | None:
        """Remove and return the block ``block_id`` cached under ``block_hash``."""
        blocks = self._cache.pop(block_hash, None)
        if blocks is None:
            return None
        if isinstance(blocks, KVCacheBlock):
            if blocks.block_id == block_id:
                return blocks
            self._cache[block_hash] = blocks
            return None
        block = blocks.pop(block_id, None)
        if len(blocks) == 1:
            self._cache[block_hash] = next(iter(blocks.values()))
        elif blocks:
            self._cache[block_hash] = blocks
        return block

    def items(self) -> Iterable[tuple[BlockHash, list[KVCacheBlock]]]:
        for block_hash in self._cache:
            yield block_hash, self.get_all_blocks(block_hash)

    def clear(self) -> None:
        self._cache.clear()


class BlockPool:
    """Ref-counted KV-cache blocks with an LRU free queue and a prefix cache.

    ``tenant`` arguments name who asks (``Request.tenant``); this pool ignores them: every
    block is evicted in one LRU order.  ``TenantBlockPool`` keeps tenants within their share.
    """

    # What a subclass's blocks and free queue are (TenantBlockPool's carry their tenant).
    block_type: type[KVCacheBlock] = KVCacheBlock
    free_queue_type: type[FreeKVCacheBlockQueue] = FreeKVCacheBlockQueue

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        observer: KVCacheEventObserver | None = None,
    ) -> None:
        check_num_blocks(num_blocks)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.observer = observer
        block_type = self.block_type
        self.blocks: list[KVCacheBlock] = [block_type(i) for i in range(num_blocks)]
        self.free_block_queue = self.free_queue_type(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # The null block pads block tables; it is never allocated, freed or cached.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    # -- lookups ---------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """A cached block with this hash, or ``None`` on a miss."""
        return self.cached_block_hash_to_block.get_one_block(block_hash)

    def get_num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free, cached or not)."""
        return self.free_block_queue.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Every block but the null block."""
        return self.num_blocks - 1

    def cached_blocks_by_tenant(self) -> dict[str, int]:
        """Each tenant's cached blocks: none here, where blocks are not counted by tenant (``TenantBlockPool``)."""
        return {}

    def get_usage(self) -> float:
        """Fraction of the usable blocks referenced by requests, in [0, 1]."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_usable_blocks

    # -- allocation ------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int, tenant: str | None = None) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue.

        Cached blocks among them are evicted (their hashes cleared, a removed
        event sent).  Raises ``ValueError`` when fewer blocks are free.
        """
        if num_blocks < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({num_blocks})")
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only "
                f"{self.free_block_queue.num_free_blocks} are free"
            )
        blocks = self._take_free_blocks(num_blocks, tenant)
        self.uncache_blocks(blocks)
        for block in blocks:
            block.ref_cnt = 1
        return blocks

    def _take_free_blocks(self, num_blocks: int, tenant: str | None) -> list[KVCacheBlock]:
        """Which ``num_blocks`` free blocks an allocation takes out of the queue (as many are free):
        the least recently used, from its head.  ``TenantBlockPool`` chooses otherwise."""
        return self.free_block_queue.popleft_n(num_blocks)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (a cache hit), taking free ones out of the queue."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in order.

        Blocks whose count reaches zero join the free queue's tail in the given
        order, so the caller decides which are evicted first (a finished
        request passes its blocks in reverse: its prefix is evicted last).
        """
        blocks = ordered_blocks if isinstance(ordered_blocks, list) else list(ordered_blocks)
        to_free: list[KVCacheBlock] = []
        for index, block in enumerate(blocks):
            if block.is_null:
                continue
            ref_cnt = block.ref_cnt - 1
            if ref_cnt < 0:
                # Undo this call's releases so that a rejected free changes nothing.
                for done in blocks[:index]:
                    if not done.is_null:
                        done.ref_cnt += 1
                raise ValueError(f"block {block.block_id} freed more often than it was referenced")
            block.ref_cnt = ref_cnt
            if ref_cnt == 0:
                to_free.append(block)
        self.free_block_queue.append_n(to_free)

    # -- prefix cache ----------------------------------------------------------

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        tenant: str | None = None,
    ) -> None:
        """Cache ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes.

        ``blocks`` is a request's block table and ``block_hashes`` the hashes of
        its full blocks (at least ``num_full_blocks`` of them).
        """
        if num_cached_blocks >= num_full_blocks or not self.enable_caching:
            return
        if len(block_hashes) < num_full_blocks:
            raise ValueError(
                f"need {num_full_blocks} block hashes to cache full blocks, got {len(block_hashes)}"
            )
        insert = self.cached_block_hash_to_block.insert
        stored_hashes: list[BlockHash] = []
        stored_ids: list[int] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue
            block_hash = block_hashes[i]
            block.block_hash = block_hash
            insert(block_hash, block)
            stored_hashes.append(block_hash)
            stored_ids.append(block.block_id)
        if stored_hashes and self.observer is not None:
            self.observer.blocks_stored(stored_hashes, stored_ids)

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take ``blocks`` out of the prefix cache (those cached; one removed event is sent).

        Blocks being reused (evicted), or whose KV was never written (a failed
        step).  They stay where they are, free or held.
        """
        removed_hashes: list[BlockHash] = []
        removed_ids: list[int] = []
        pop_cached = self.cached_block_hash_to_block.pop
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None:  # the null block is never cached (cache_full_blocks)
                continue
            pop_cached(block_hash, block.block_id)
            block.block_hash = None
            removed_hashes.append(block_hash)
            removed_ids.append(block.block_id)
        if removed_hashes and self.observer is not None:
            self.observer.blocks_removed(removed_hashes, removed_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is referenced.

        Returns ``False`` (and changes nothing) while requests hold blocks.
        """
        num_used = self.num_usable_blocks - self.free_block_queue.num_free_blocks
        if num_used > 0:
            logger.warning("cannot reset the prefix cache: %d blocks are still in use", num_used)
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.observer is not None:
            self.observer.all_blocks_cleared()
        return True
