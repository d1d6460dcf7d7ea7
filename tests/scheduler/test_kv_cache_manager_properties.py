"""KVCacheManager invariants under random admissions, chunked prefills, decodes and frees.

A hypothesis state machine plays the scheduler's part: it admits requests
(prefix lookup, then slots for some or all of the uncomputed tokens), computes
more of them, decodes, and frees them, advancing ``num_computed_tokens`` itself.
Prompts are drawn from a two-token alphabet so that prefixes are shared and
cache hits are common.  After every rule the pool invariants hold with the
references counted from the request tables, every table covers exactly its
request's computed tokens, and every full computed block carries the hash of
the request's own tokens.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.scheduler.block_hash import BlockHasher
from kvserve.scheduler.kv_cache_manager import KVCacheManager
from kvserve.scheduler.request import Request
from tests.scheduler.test_block_pool_properties import (
    CacheIndexObserver,
    assert_pool_invariants,
    cached_pairs,
    free_block_ids,
)

TOKENS = st.integers(0, 1)
PROMPTS = st.lists(TOKENS, min_size=1, max_size=12)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def test_failed_allocation_leaves_no_block_table() -> None:
    """``allocate_slots`` returning ``None`` must leave the manager as it was.

    A request that never got a block must not get a (leaked) table entry: the
    scheduler never frees a request it aborts while it waits.
    """
    manager = KVCacheManager(num_blocks=3, block_size=2)
    request = Request("r0", [1, 2, 3, 4, 5])  # needs 3 blocks; 2 are usable

    assert manager.allocate_slots(request, request.num_tokens) is None

    assert manager.get_block_ids("r0") == []
    assert "r0" not in manager.req_to_blocks
    assert "r0" not in manager.num_cached_blocks


class KVCacheManagerMachine(RuleBasedStateMachine):
    """Drives one KVCacheManager; ``requests`` are those holding (or owed) blocks."""

    @initialize(num_blocks=st.integers(2, 10), block_size=st.integers(2, 4))
    def create_manager(self, num_blocks: int, block_size: int) -> None:
        self.observer = CacheIndexObserver()
        self.manager = KVCacheManager(num_blocks, block_size, observer=self.observer)
        self.pool = self.manager.block_pool
        self.block_size = block_size
        self.hasher = BlockHasher(block_size)
        self.requests: dict[str, Request] = {}
        self.num_added = 0

    # -- helpers -----------------------------------------------------------------

    def snapshot(self) -> tuple[object, ...]:
        """Everything an allocation could change."""
        return (
            self.manager.get_num_free_blocks(),
            [block.ref_cnt for block in self.pool.blocks],
            [block.block_hash for block in self.pool.blocks],
            free_block_ids(self.pool),
            {req_id: self.manager.get_block_ids(req_id) for req_id in self.requests},
        )

    def pick(self, data: st.DataObject, ready: bool) -> Request:
        """A request with uncomputed tokens (``ready=False``) or with all of them computed."""
        req_ids = sorted(
            req_id
            for req_id, request in self.requests.items()
            if (request.num_computed_tokens == request.num_tokens) == ready
        )
        return self.requests[data.draw(st.sampled_from(req_ids), label="req_id")]

    def has_request(self, ready: bool) -> bool:
        return any((r.num_computed_tokens == r.num_tokens) == ready for r in self.requests.values())

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Slots for ``num_new_tokens`` more tokens of a request that already has a table."""
        before = self.snapshot()
        table_before = list(self.manager.req_to_blocks[request.req_id])
        new_blocks = self.manager.allocate_slots(request, num_new_tokens)
        if new_blocks is None:
            assert self.snapshot() == before, "a failed allocation changed the pool or a table"
            return
        request.num_computed_tokens += num_new_tokens
        assert self.manager.req_to_blocks[request.req_id] == table_before + new_blocks
        assert all(block.ref_cnt == 1 for block in new_blocks)

    # -- rules -------------------------------------------------------------------

    @rule(prompt=PROMPTS, chunk=st.none() | st.integers(1, 8))
    def add_request(self, prompt: list[int], chunk: int | None) -> None:
        request = Request(f"r{self.num_added}", prompt)
        self.num_added += 1
        expected_hashes = self.hasher.hash_token_ids(prompt)

        hit = self.manager.get_computed_blocks(request)

        assert request.block_hashes == expected_hashes
        num_hit_blocks = len(hit.blocks)
        assert hit.num_tokens == num_hit_blocks * self.block_size
        assert hit.num_tokens < request.num_tokens, "a hit must leave the last token to compute"
        assert [block.block_hash for block in hit.blocks] == expected_hashes[:num_hit_blocks]
        # The hit is the longest cached run the rule above allows.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if num_hit_blocks < max_hit_blocks:
            assert self.pool.get_cached_block(expected_hashes[num_hit_blocks]) is None

        num_new_tokens = request.num_tokens - hit.num_tokens
        if chunk is not None:
            num_new_tokens = min(num_new_tokens, chunk)
        before = self.snapshot()
        new_blocks = self.manager.allocate_slots(request, num_new_tokens, hit)
        if new_blocks is None:
            assert self.snapshot() == before, "a failed admission changed the pool or a table"
            assert self.manager.get_block_ids(request.req_id) == []
            return
        request.num_computed_tokens = hit.num_tokens + num_new_tokens
        self.requests[request.req_id] = request
        assert self.manager.req_to_blocks[request.req_id] == hit.blocks + new_blocks

    @precondition(lambda self: self.has_request(ready=False))
    @rule(data=st.data(), chunk=st.integers(1, 8))
    def compute_more_tokens(self, data: st.DataObject, chunk: int) -> None:
        request = self.pick(data, ready=False)
        self.allocate(request, min(request.num_tokens - request.num_computed_tokens, chunk))

    @precondition(lambda self: self.has_request(ready=True))
    @rule(data=st.data(), token=TOKENS)
    def decode_one_token(self, data: st.DataObject, token: int) -> None:
        request = self.pick(data, ready=True)
        # The sampled token joins the sequence; if no slot is left it stays
        # uncomputed, and compute_more_tokens retries it later.
        request.append_output_token(token)
        self.allocate(request, 1)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free_request(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.requests)), label="req_id")
        request = self.requests.pop(req_id)
        table = list(self.manager.req_to_blocks[req_id])
        free_before = free_block_ids(self.pool)

        self.manager.free(request)

        # Last block first, so that the prefix is evicted last.
        newly_free = [block.block_id for block in reversed(table) if block.ref_cnt == 0]
        assert free_block_ids(self.pool) == free_before + newly_free
        assert self.manager.get_block_ids(req_id) == []

    @rule()
    def reset_prefix_cache(self) -> None:
        any_block_held = any(self.manager.get_block_ids(req_id) for req_id in self.requests)
        assert self.manager.reset_prefix_cache() == (not any_block_held)

    # -- invariants --------------------------------------------------------------

    @invariant()
    def pool_references_are_the_request_tables(self) -> None:
        tables = {req_id: blocks for req_id, blocks in self.manager.req_to_blocks.items() if blocks}
        assert set(tables) <= set(self.requests), "a freed request still holds blocks"
        references = Counter(block.block_id for blocks in tables.values() for block in blocks)
        assert_pool_invariants(self.pool, references)

    @invariant()
    def tables_cover_exactly_the_computed_tokens(self) -> None:
        for req_id, request in self.requests.items():
            table = self.manager.req_to_blocks[req_id]
            assert len(table) == ceil_div(request.num_computed_tokens, self.block_size)
            assert len({block.block_id for block in table}) == len(table)
            assert all(not block.is_null for block in table)

    @invariant()
    def full_computed_blocks_carry_the_hash_of_their_tokens(self) -> None:
        for req_id, request in self.requests.items():
            table = self.manager.req_to_blocks[req_id]
            computed_tokens = request.all_token_ids[: request.num_computed_tokens]
            expected = self.hasher.hash_token_ids(computed_tokens)
            assert [block.block_hash for block in table[: len(expected)]] == expected
            # A partly filled block is never cached.
            assert all(block.block_hash is None for block in table[len(expected) :])
            # The request's own hash list agrees with a fresh hash of its tokens.
            assert request.block_hashes[: len(expected)] == expected

    @invariant()
    def observer_index_matches_the_hash_map(self) -> None:
        assert self.observer.pairs == cached_pairs(self.pool)

    def teardown(self) -> None:
        if not hasattr(self, "manager"):
            return
        for request in list(self.requests.values()):
            self.manager.free(request)
        self.requests.clear()
        assert_pool_invariants(self.pool, {})
        assert self.manager.get_num_free_blocks() == self.pool.num_blocks - 1
        assert self.manager.reset_prefix_cache()


KVCacheManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)
TestKVCacheManagerStateMachine = KVCacheManagerMachine.TestCase
