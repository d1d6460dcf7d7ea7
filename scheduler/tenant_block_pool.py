"""A ``BlockPool`` in which no tenant can evict the others' prefix cache by flooding it.

Tenants (authenticated callers) never hit each other's cached blocks (their cache salts
differ), but a plain ``BlockPool`` evicts everyone's free blocks in one LRU order: a tenant
that sends many unique prompts pushes every other tenant's prefixes off the head of the
free queue.  Here each cached block remembers its *owner*, the tenant of the request that
cached it; the pool counts each tenant's cached blocks (free or held: a block that several
requests hold counts once), and links each tenant's free cached blocks, and the free
uncached ones, in the free queue's order, into lists of their own::

    free queue:  head <-> a1 <-> b1 <-> u1 <-> a2 <-> b2 <-> u2 <-> b3 <-> tail
    tenant a:    head <-> a1 <-> a2 <-> tail
    tenant b:    head <-> b1 <-> b2 <-> b3 <-> tail
    uncached:    head <-> u1 <-> u2 <-> tail

A tenant whose cached blocks number more than ``share`` x the usable blocks is *over its
share*.  The rule: while some tenant is over its share, a block cached by a tenant within
its share is not evicted if another free block will do.  When the free queue's head is
such a block, the block taken instead is the oldest free uncached block, or else the least
recently used free cached block of a tenant over its share (the requester's own first);
only when there is neither is the head taken.  Any other head (uncached, or an over-share
tenant's) is taken as usual.  With no tenant over its share, blocks are taken from the
head exactly as in a plain pool, and so is every block of a server without tenants.

NOTE: why this rule rather than a quota per tenant.  It binds only when a tenant is over
its share, and only to protect the others: a tenant alone on the server still fills the
whole pool, and a request never waits for a block that is free.  It also protects a
tenant from the slack being taken: a flood fills the free uncached blocks first (its
count goes over its share), but the next block anyone needs comes out of the flood's own
cache, not out of a tenant's within its share.  Every operation stays O(1) per block (the
lists are intrusive, like the free queue), but for finding an over-share tenant with a
free cached block: at most 1 / share tenants can be over their share at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvserve.scheduler.block_hash import BlockHash
from kvserve.scheduler.block_pool import BlockPool, KVCacheEventObserver
from kvserve.scheduler.checks import check_tenant_cache_share
from kvserve.scheduler.kv_cache_block import FreeKVCacheBlockQueue, KVCacheBlock


def blocks_within_share(num_blocks: int, share: float) -> int:
    """The cached blocks a tenant may hold and stay within ``share`` of a pool of ``num_blocks``
    (the null block among them): those that, while another tenant is over its share, are evicted last."""
    return int(share * (num_blocks - 1))


class TenantKVCacheBlock(KVCacheBlock):
    """A block that also knows the tenant that cached it, and its place in a ``FreeList``.

    ``owner`` is set only while the block is cached (has a hash).  While the block is free,
    its links place it in its owner's free list, or, uncached, in the list of free uncached
    blocks (a cached block without an owner is in neither).
    """

    __slots__ = ("owner", "prev_owned_free", "next_owned_free")

    def __init__(self, block_id: int) -> None:
        super().__init__(block_id)
        self.owner: TenantCache | None = None
        self.prev_owned_free: TenantKVCacheBlock | None = None
        self.next_owned_free: TenantKVCacheBlock | None = None


class FreeList:
    """Free blocks in the free queue's order, as an intrusive doubly linked list of their own.

    NOTE: but for a free block that leaves the cache (a failed step's): it joins the list of
    uncached blocks at its tail, whatever its place in the free queue.
    """

    __slots__ = ("fake_head", "fake_tail")

    def __init__(self) -> None:
        self.fake_head = TenantKVCacheBlock(-1)
        self.fake_tail = TenantKVCacheBlock(-1)
        self.fake_head.next_owned_free = self.fake_tail
        self.fake_tail.prev_owned_free = self.fake_head

    def append(self, block: TenantKVCacheBlock) -> None:
        tail = self.fake_tail
        last = tail.prev_owned_free
        last.next_owned_free = block  # type: ignore[union-attr]
        block.prev_owned_free = last
        block.next_owned_free = tail
        tail.prev_owned_free = block

    def lru_block(self) -> TenantKVCacheBlock | None:
        """The least recently freed block, ``None`` when the list is empty."""
        block = self.fake_head.next_owned_free
        return None if block is self.fake_tail else block

    def blocks(self) -> list[TenantKVCacheBlock]:
        """Every block, least recently freed first."""
        blocks = []
        block = self.fake_head.next_owned_free
        while block is not self.fake_tail:
            blocks.append(block)
            block = block.next_owned_free  # type: ignore[union-attr]
        return blocks  # type: ignore[return-value]


class TenantCache(FreeList):
    """One tenant's cached blocks: how many, and its free ones in LRU order."""

    __slots__ = ("name", "num_cached_blocks")

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.num_cached_blocks = 0


def _unlink_owned(block: TenantKVCacheBlock) -> None:
    """Take ``block`` out of its owner's free list (it is in one)."""
    prev, nxt = block.prev_owned_free, block.next_owned_free
    prev.next_owned_free = nxt  # type: ignore[union-attr]
    nxt.prev_owned_free = prev  # type: ignore[union-attr]
    block.prev_owned_free = block.next_owned_free = None


class TenantFreeBlockQueue(FreeKVCacheBlockQueue):
    """The free queue, keeping the owners' free lists and the list of free uncached blocks in
    step: a block in the queue is in its owner's list if it has one, in ``uncached`` if it has
    no hash (a cached block without an owner is in neither), in the queue's order."""

    __slots__ = ("uncached",)

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.uncached = FreeList()
        super().__init__(blocks)

    def popleft(self) -> KVCacheBlock:
        block = super().popleft()
        if block.prev_owned_free is not None:  # type: ignore[attr-defined]
            _unlink_owned(block)  # type: ignore[arg-type]
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        blocks = super().popleft_n(n)
        for block in blocks:
            if block.prev_owned_free is not None:  # type: ignore[attr-defined]
                _unlink_owned(block)  # type: ignore[arg-type]
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        super().remove(block)
        if block.prev_owned_free is not None:  # type: ignore[attr-defined]
            _unlink_owned(block)  # type: ignore[arg-type]

    def append(self, block: KVCacheBlock) -> None:
        super().append(block)
        self._link(block)

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = blocks if isinstance(blocks, list) else list(blocks)
        super().append_n(blocks)
        for block in blocks:
            self._link(block)

    def _link(self, block: KVCacheBlock) -> None:
        owner = block.owner  # type: ignore[attr-defined]
        if owner is not None:
            owner.append(block)
        elif block.block_hash is None:
            self.uncached.append(block)  # type: ignore[arg-type]


class TenantBlockPool(BlockPool):
    """A ``BlockPool`` in which, while a tenant is over ``share`` of the usable blocks, the
    cached blocks of tenants within their share are evicted last (module docstring)."""

    block_type = TenantKVCacheBlock
    free_queue_type = TenantFreeBlockQueue

    def __init__(
        self,
        num_blocks: int,
        share: float,
        enable_caching: bool = True,
        observer: KVCacheEventObserver | None = None,
    ) -> None:
        if share is None:
            raise ValueError("tenant_cache_share must be a number in (0, 1], got None")
        check_tenant_cache_share(share)
        super().__init__(num_blocks, enable_caching, observer)
        self.share = share
        # A tenant holding more cached blocks than this is over its share.
        self.max_cached_blocks_per_tenant = blocks_within_share(num_blocks, share)
        self._tenants: dict[str, TenantCache] = {}
        # The tenants over their share, as an ordered set.
        self._over_share: dict[TenantCache, None] = {}

    # -- lookups ---------------------------------------------------------------

    def num_cached_blocks(self, tenant: str) -> int:
        """Blocks cached by ``tenant``'s requests and still cached, free or held."""
        record = self._tenants.get(tenant)
        return 0 if record is None else record.num_cached_blocks

    def cached_blocks_by_tenant(self) -> dict[str, int]:
        """Each tenant's ``num_cached_blocks``, for those that have any."""
        return {name: record.num_cached_blocks for name, record in self._tenants.items() if record.num_cached_blocks}

    def tenants_over_share(self) -> list[str]:
        """The tenants whose cached blocks number more than ``max_cached_blocks_per_tenant``."""
        return [record.name for record in self._over_share]

    def tenant_free_blocks(self, tenant: str) -> list[TenantKVCacheBlock]:
        """``tenant``'s free cached blocks, least recently freed first."""
        record = self._tenants.get(tenant)
        return [] if record is None else record.blocks()

    def uncached_free_blocks(self) -> list[TenantKVCacheBlock]:
        """The free blocks without a hash, least recently freed first."""
        return self.free_block_queue.uncached.blocks()  # type: ignore[attr-defined]

    # -- allocation ------------------------------------------------------------

    def _take_free_blocks(self, num_blocks: int, tenant: str | None) -> list[KVCacheBlock]:
        """The queue's head, but while a tenant is over its share, a block cached by a tenant within
        its share is taken only when no other free block will do (module docstring)."""
        over = self._over_share
        if not over:
            return super()._take_free_blocks(num_blocks, tenant)
        record = self._tenants.get(tenant) if tenant is not None else None
        donors = [record, *(r for r in over if r is not record)] if record in over else list(over)
        queue = self.free_block_queue
        head = queue.fake_head
        uncached = queue.uncached  # type: ignore[attr-defined]
        blocks: list[KVCacheBlock] = []
        for _ in range(num_blocks):
            block = head.next_free_block
            if block.block_hash is not None and block.owner not in over:  # type: ignore[union-attr]
                block = uncached.lru_block() or _first_lru_block(donors) or block
            queue.remove(block)  # type: ignore[arg-type]
            blocks.append(block)  # type: ignore[arg-type]
        return blocks

    # -- prefix cache ----------------------------------------------------------

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        tenant: str | None = None,
    ) -> None:
        """``BlockPool.cache_full_blocks``; the blocks it caches are ``tenant``'s.

        NOTE: only blocks held by a request get an owner (a request caches its own blocks):
        a free one would have to join its owner's list at its place in the free queue.
        """
        if num_cached_blocks >= num_full_blocks or not self.enable_caching:
            return
        uncached = [block for block in blocks[num_cached_blocks:num_full_blocks] if block.block_hash is None]
        super().cache_full_blocks(blocks, block_hashes, num_cached_blocks, num_full_blocks)
        record = None
        if tenant is not None:
            record = self._tenants.get(tenant)
            if record is None:
                record = self._tenants[tenant] = TenantCache(tenant)
        for block in uncached:
            if block.block_hash is None:  # the null block
                continue
            if block.prev_owned_free is not None:  # type: ignore[attr-defined]
                _unlink_owned(block)  # type: ignore[arg-type]  # free: no longer uncached
            elif record is not None and block.ref_cnt > 0:
                block.owner = record  # type: ignore[attr-defined]
                record.num_cached_blocks += 1
        if record is not None and record.num_cached_blocks > self.max_cached_blocks_per_tenant:
            self._over_share[record] = None

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = blocks if isinstance(blocks, list) else list(blocks)
        max_cached = self.max_cached_blocks_per_tenant
        for block in blocks:
            owner = block.owner  # type: ignore[attr-defined]
            if owner is not None:
                if block.prev_owned_free is not None:  # type: ignore[attr-defined]
                    _unlink_owned(block)  # type: ignore[arg-type]
                owner.num_cached_blocks -= 1
                if owner.num_cached_blocks <= max_cached:
                    self._over_share.pop(owner, None)
                block.owner = None  # type: ignore[attr-defined]
        super().uncache_blocks(blocks)
        uncached = self.free_block_queue.uncached  # type: ignore[attr-defined]
        for block in blocks:
            # A free block that left the cache (a failed step's) is an uncached free block now.
            if block.prev_free_block is not None and block.prev_owned_free is None:  # type: ignore[attr-defined]
                uncached.append(block)

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache():
            return False
        for block in self.blocks:
            block.owner = None  # type: ignore[attr-defined]
            block.prev_owned_free = block.next_owned_free = None  # type: ignore[attr-defined]
        self._tenants.clear()
        self._over_share.clear()
        queue = self.free_block_queue
        queue.uncached = uncached = FreeList()  # type: ignore[attr-defined]
        for block in queue:
            uncached.append(block)  # type: ignore[arg-type]
        return True


def _first_lru_block(records: list[TenantCache]) -> TenantKVCacheBlock | None:
    """The least recently used free cached block of the first of ``records`` that has one."""
    for record in records:
        block = record.lru_block()
        if block is not None:
            return block
    return None
