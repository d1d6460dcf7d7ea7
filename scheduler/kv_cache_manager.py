"""Per-request block tables on top of one ``BlockPool``, with prefix caching.

The manager owns each request's list of blocks.  A request first looks up
the longest run of cached full blocks of its prompt (``get_computed_blocks``),
then asks for slots for the tokens it will compute (``allocate_slots``).
Blocks are cached as soon as the tokens scheduled into them fill them, and a
finished request frees its blocks last-to-first so that its prefix blocks are
evicted last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.scheduler.block_hash import BlockHasher, num_cacheable_blocks, token_ids_to_bytes
from kvserve.scheduler.block_pool import BlockPool, KVCacheEventObserver
from kvserve.scheduler.config import CacheConfig
from kvserve.scheduler.kv_cache_block import KVCacheBlock
from kvserve.scheduler.prompt_logprobs import max_cached_tokens
from kvserve.scheduler.request import Request
from kvserve.scheduler.tenant_block_pool import TenantBlockPool


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """A prefix-cache hit: cached full blocks and the prompt tokens they cover."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_tokens: int = 0


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache lookups: tokens queried and tokens found cached."""

    num_requests: int = 0
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


_NO_HIT = ComputedBlocks()


class KVCacheManager:
    """Allocates and frees the KV-cache blocks of one replica's requests.

    The blocks a request caches are its tenant's (``Request.tenant``); with a
    ``tenant_cache_share`` the pool is a ``TenantBlockPool``: while a tenant's cached blocks
    are over that share of the pool, the others' cached blocks are evicted last.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        model_id: str = "",
        observer: KVCacheEventObserver | None = None,
        tenant_cache_share: float | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hasher = BlockHasher(block_size, model_id)
        if tenant_cache_share is not None and enable_caching:
            self.block_pool: BlockPool = TenantBlockPool(num_blocks, tenant_cache_share, enable_caching, observer)
        else:
            self.block_pool = BlockPool(num_blocks, enable_caching, observer)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each request that are already in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @classmethod
    def from_config(cls, config: CacheConfig, observer: KVCacheEventObserver | None = None) -> KVCacheManager:
        """The manager of one replica's pool as ``config`` describes it."""
        return cls(
            config.num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            model_id=config.model_id,
            observer=observer,
            tenant_cache_share=config.tenant_cache_share,
        )

    # -- hashing ---------------------------------------------------------------

    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to every full block of its tokens."""
        block_hashes = request.block_hashes
        num_hashed = len(block_hashes)
        if (num_hashed + 1) * self.block_size > request.num_tokens:
            return
        parent = block_hashes[-1] if num_hashed else None
        block_hashes.extend(
            self.hasher.hash_token_ids(request.all_token_ids, request.cache_salt, parent, num_hashed)
        )

    def hash_new_request(self, request: Request) -> None:
        """Hash the full blocks of a request about to be queued, and check that the rest can be hashed.

        ``ValueError`` for a token id outside [0, 2**32), before the request
        is anywhere: its last, partial block would be hashed once a step
        fills it.  Nothing to do without caching.
        """
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        token_ids_to_bytes(request.all_token_ids[len(request.block_hashes) * self.block_size :])

    # -- lookups ---------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest run of cached full blocks at the start of ``request``.

        Never covers the whole sequence: at least its last token is recomputed,
        because a step must produce the logits to sample from.  Touches nothing.
        """
        if not self.enable_caching:
            return _NO_HIT
        self.update_block_hashes(request)
        max_hit_blocks = num_cacheable_blocks(request.num_tokens, self.block_size)
        if (max_tokens := max_cached_tokens(request)) is not None:  # cached tokens have no prompt logprobs
            max_hit_blocks = min(max_hit_blocks, max_tokens // self.block_size)
        get_cached = self.block_pool.cached_block_hash_to_block.get_one_block
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = get_cached(block_hash)
            if block is None:
                break
            blocks.append(block)
        return ComputedBlocks(blocks, len(blocks) * self.block_size) if blocks else _NO_HIT

    def get_block_ids(self, req_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(req_id, ())]

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_usage(self) -> float:
        return self.block_pool.get_usage()

    # -- allocation ------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: ComputedBlocks | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        ``new_computed_blocks`` is a prefix-cache hit from
        ``get_computed_blocks`` for a request being scheduled from the waiting
        queue; its blocks join the request's table, and the lookup counts in
        ``prefix_cache_stats`` (only then: a request that waits for blocks is
        looked up again at every step).  Returns the newly allocated blocks
        (possibly none), or ``None`` when the pool cannot serve the request, in
        which case nothing was touched, allocated or counted.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if new_computed_blocks is None and request.num_computed_tokens + num_new_tokens <= request.kv_room:
            # Fast path of a decode step: room left in the last block, and no
            # block becomes full.
            return []
        block_size = self.block_size
        req_id = request.req_id
        req_blocks = self.req_to_blocks.get(req_id)
        computed = new_computed_blocks.blocks if new_computed_blocks is not None else ()
        num_computed_tokens = request.num_computed_tokens + len(computed) * block_size
        num_tokens_needed = num_computed_tokens + num_new_tokens
        num_held = len(req_blocks) if req_blocks is not None else 0
        num_new_blocks = -(-num_tokens_needed // block_size) - num_held - len(computed)
        pool = self.block_pool
        # Touching a free cached block takes it off the free queue.
        num_evictable = sum(1 for block in computed if block.ref_cnt == 0) if computed else 0
        if num_new_blocks > pool.free_block_queue.num_free_blocks - num_evictable:
            return None
        if new_computed_blocks is not None and self.enable_caching:
            stats = self.prefix_cache_stats
            stats.num_requests += 1
            stats.num_queried_tokens += request.num_tokens
            stats.num_hit_tokens += new_computed_blocks.num_tokens
        if req_blocks is None:
            req_blocks = self.req_to_blocks[req_id] = []
            self.num_cached_blocks[req_id] = 0
        if computed:
            pool.touch(computed)
            req_blocks.extend(computed)
            self.num_cached_blocks[req_id] += len(computed)
        if num_new_blocks > 0:
            new_blocks = pool.get_new_blocks(num_new_blocks, request.tenant)
            req_blocks.extend(new_blocks)
        else:
            new_blocks = []
        room = len(req_blocks) * block_size
        if self.enable_caching:
            num_full_blocks = min(num_tokens_needed, request.num_tokens) // block_size
            num_cached = self.num_cached_blocks[req_id]
            if num_full_blocks > num_cached:
                self.update_block_hashes(request)
                pool.cache_full_blocks(req_blocks, request.block_hashes, num_cached, num_full_blocks, request.tenant)
                self.num_cached_blocks[req_id] = num_cached = num_full_blocks
            # Past this length the next uncached block would be full: it must be cached.
            room = min(room, (num_cached + 1) * block_size - 1)
        request.kv_room = room
        return new_blocks

    def free(self, request: Request) -> None:
        """Release every block of ``request``, last block first."""
        req_blocks = self.req_to_blocks.pop(request.req_id, None)
        self.num_cached_blocks.pop(request.req_id, None)
        request.kv_room = 0
        if req_blocks:
            self.block_pool.free_blocks(reversed(req_blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
