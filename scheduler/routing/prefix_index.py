"""The fleet-wide prefix index: block hash -> the replicas whose pool caches it.

Kept exactly from the pools' own events (``KVCacheEventObserver``): pools and
router live in one process, so there is no staleness to model.  One hash can
be cached by several blocks of one pool (two requests computed it at once),
so the index counts copies per (hash, replica): removing one of two copies
keeps the entry.

Because block hashes chain their prefix, a request's blocks ``0..k-1`` are all
cached on a replica iff the replica holds block hashes ``0..k-1``; a match
walks the chain once for every replica together::

    hashes      h0      h1      h2      h3
    holders   {0,1,2}  {0,2}   {2,5}   {}
    candidates {0,1,2} {0,2}   {2}     {}   -> {0: 2, 1: 1, 2: 3}

NOTE: the holders of a hash are a bit mask (an ``int``, bit ``r`` for
replica ``r``), not a ``set``: a system prompt is cached on every replica,
and with sets each block of its walk cost a set difference over all of
them (23 ms per match for 256 replicas and 2,000 blocks).  A mask operation
costs one machine word per 64 replicas, so a walk is O(blocks) for fleets
of hundreds of replicas, plus O(replicas) to report the matches.

Pending blocks: a pool caches a prompt's blocks chunk by chunk as it
schedules them, so while a replica computes a long document the index holds
only its first chunks, and a second request for the document saw most of it
uncached there.  The router can record the blocks of every request it sends
(``add_pending``); each stays pending on that replica until its pool caches
it (or the replica is cleared), and ``match(..., pending=True)`` counts
pending blocks as held.  A request that leaves its replica without computing
some of its blocks (refused there, or aborted before its prefill finished)
takes them back (``drop_pending``).  The index counts the requests that
brought each pending block, so that one request taken back leaves the
block pending for another still on its way to compute it.  Each
``add_pending`` returns a claim (a sequence number) that its request gives
back to ``drop_pending``: a block cached since, evicted, and brought again
by a later request is that request's, and the earlier one's withdrawal
leaves it pending.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.scheduler.block_hash import BlockHash


class GlobalPrefixIndex:
    """Which replicas cache which blocks, from every replica pool's events."""

    __slots__ = ("_holders", "_copies", "_pending", "_pending_of", "_next_claim", "_observers")

    def __init__(self) -> None:
        # hash -> bit mask of the replicas holding at least one copy.
        self._holders: dict[BlockHash, int] = {}
        # replica -> hash -> number of its cached blocks with that hash.
        self._copies: dict[int, dict[BlockHash, int]] = {}
        # hash -> bit mask of the replicas it is pending on, and replica -> its pending hashes,
        # each with the number of routed requests that brought it there and the claim
        # (add_pending's sequence number) of the first of them.
        self._pending: dict[BlockHash, int] = {}
        self._pending_of: dict[int, dict[BlockHash, tuple[int, int]]] = {}
        self._next_claim = 0
        # replica -> the observer of its current pool (observer_for retires the one it replaces).
        self._observers: dict[int, ReplicaIndexObserver] = {}

    # -- events ------------------------------------------------------------------

    def observer_for(self, replica_id: int) -> ReplicaIndexObserver:
        """The ``KVCacheEventObserver`` to give replica ``replica_id``'s new pool.

        A new pool caches nothing: whatever an earlier pool of the replica
        cached (one that crashed without resetting) is forgotten, and the
        earlier pool's observer stops forwarding its events.
        """
        if isinstance(replica_id, bool) or not isinstance(replica_id, int) or replica_id < 0:
            raise ValueError(f"replica_id must be a non-negative integer, got {replica_id!r}")
        self.clear_replica(replica_id)
        self._copies.setdefault(replica_id, {})
        replaced = self._observers.get(replica_id)
        if replaced is not None:
            replaced.active = False
        observer = self._observers[replica_id] = ReplicaIndexObserver(self, replica_id)
        return observer

    def add_blocks(self, replica_id: int, block_hashes: Sequence[BlockHash]) -> None:
        copies = self._copies.setdefault(replica_id, {})
        holders = self._holders
        bit = 1 << replica_id
        for block_hash in block_hashes:
            count = copies.get(block_hash)
            if count is None:
                copies[block_hash] = 1
                holders[block_hash] = holders.get(block_hash, 0) | bit
            else:
                copies[block_hash] = count + 1
        self._resolve_pending(replica_id, block_hashes)

    def add_pending(self, replica_id: int, block_hashes: Sequence[BlockHash]) -> int:
        """Replica ``replica_id`` was sent a request with these blocks: those it does not
        cache are pending there until it does (or every request that brought them is taken back).

        Returns the request's claim, for ``drop_pending``.
        """
        claim = self._next_claim
        self._next_claim = claim + 1
        copies = self._copies.get(replica_id, {})
        mine = self._pending_of.setdefault(replica_id, {})
        pending = self._pending
        bit = 1 << replica_id
        # A prompt may repeat a block: it brings it once.
        for block_hash in dict.fromkeys(block_hashes):
            if block_hash in copies:
                continue
            entry = mine.get(block_hash)
            if entry is None:
                mine[block_hash] = (1, claim)
                pending[block_hash] = pending.get(block_hash, 0) | bit
            else:
                mine[block_hash] = (entry[0] + 1, entry[1])
        return claim

    def drop_pending(self, replica_id: int, block_hashes: Sequence[BlockHash], claim: int) -> None:
        """The request that brought these blocks to ``replica_id`` (``add_pending``, which
        returned ``claim``) left it without computing them: each stays pending only while
        another request brought it.

        A block pending since a later claim is another request's: it was cached
        after this request brought it (which ended this request's part in it),
        evicted, and brought again.
        """
        mine = self._pending_of.get(replica_id)
        if mine:
            for block_hash in dict.fromkeys(block_hashes):
                entry = mine.get(block_hash)
                if entry is None or entry[1] > claim:
                    continue
                if entry[0] > 1:
                    mine[block_hash] = (entry[0] - 1, entry[1])
                else:
                    del mine[block_hash]
                    _drop_bit(self._pending, block_hash, replica_id)

    def _resolve_pending(self, replica_id: int, block_hashes: Sequence[BlockHash]) -> None:
        """``replica_id`` cached these blocks: none of them is pending there any more."""
        mine = self._pending_of.get(replica_id)
        if mine:
            for block_hash in block_hashes:
                if mine.pop(block_hash, None) is not None:
                    _drop_bit(self._pending, block_hash, replica_id)

    def remove_blocks(self, replica_id: int, block_hashes: Sequence[BlockHash]) -> None:
        copies = self._copies.get(replica_id)
        for block_hash in block_hashes:
            count = copies.get(block_hash) if copies is not None else None
            if count is None:
                raise ValueError(
                    f"replica {replica_id} removed block {block_hash.hex()[:8]} that it never stored"
                )
            if count > 1:
                copies[block_hash] = count - 1  # type: ignore[index]
                continue
            del copies[block_hash]  # type: ignore[union-attr]
            _drop_bit(self._holders, block_hash, replica_id)

    def clear_replica(self, replica_id: int) -> None:
        """Forget every block of ``replica_id``, cached or pending (its pool reset its prefix cache)."""
        pending = self._pending_of.get(replica_id)
        if pending:
            for block_hash in pending:
                _drop_bit(self._pending, block_hash, replica_id)
            pending.clear()
        copies = self._copies.get(replica_id)
        if not copies:
            return
        for block_hash in copies:
            _drop_bit(self._holders, block_hash, replica_id)
        copies.clear()

    # -- queries -----------------------------------------------------------------

    def match(self, block_hashes: Sequence[BlockHash], *, pending: bool = False) -> dict[int, int]:
        """Replica -> number of leading blocks of ``block_hashes`` it caches
        (or, with ``pending``, caches or has pending).

        Replicas that cache not even the first block are absent.  One walk of
        the chain: the candidate mask only shrinks and the walk stops when it
        is empty.
        """
        if not block_hashes:
            return {}
        holders_of = self._holders.get
        # NOTE: None rather than an empty dict's get, so the usual walk pays one test per block.
        pending_of = self._pending.get if pending and self._pending else None
        candidates = holders_of(block_hashes[0], 0)
        if pending_of is not None:
            candidates |= pending_of(block_hashes[0], 0)
        if not candidates:
            return {}
        matched: dict[int, int] = {}
        num_blocks = len(block_hashes)
        for position in range(1, num_blocks):
            block_hash = block_hashes[position]
            replicas = holders_of(block_hash, 0)
            if pending_of is not None:
                replicas |= pending_of(block_hash, 0)
            dropped = candidates & ~replicas
            if dropped:
                for replica_id in _bits(dropped):
                    matched[replica_id] = position
                candidates ^= dropped
                if not candidates:
                    return matched
        for replica_id in _bits(candidates):
            matched[replica_id] = num_blocks
        return matched

    def replicas_holding(self, block_hash: BlockHash) -> frozenset[int]:
        return frozenset(_bits(self._holders.get(block_hash, 0)))

    def num_copies(self, replica_id: int, block_hash: BlockHash) -> int:
        """Cached blocks of ``replica_id`` whose hash is ``block_hash``."""
        return self._copies.get(replica_id, {}).get(block_hash, 0)

    def num_blocks(self, replica_id: int) -> int:
        """Distinct block hashes ``replica_id`` caches."""
        return len(self._copies.get(replica_id, ()))

    def num_pending(self, replica_id: int) -> int:
        """Distinct block hashes pending on ``replica_id``."""
        return len(self._pending_of.get(replica_id, ()))

    def __len__(self) -> int:
        """Distinct block hashes cached anywhere."""
        return len(self._holders)


def _drop_bit(masks: dict[BlockHash, int], block_hash: BlockHash, replica_id: int) -> None:
    """Clear ``replica_id``'s bit of ``masks[block_hash]``; drop the entry once no bit is left."""
    mask = masks[block_hash] & ~(1 << replica_id)
    if mask:
        masks[block_hash] = mask
    else:
        del masks[block_hash]


def _bits(mask: int) -> list[int]:
    """The positions of the set bits of ``mask``, ascending."""
    positions = []
    if mask.bit_count() <= 8:
        while mask:
            low = mask & -mask
            positions.append(low.bit_length() - 1)
            mask ^= low
        return positions
    # Many bits (a prefix every replica caches): a scan of the binary digits,
    # least significant first, is a few times faster than peeling them off.
    digits = bin(mask)[:1:-1]
    position = digits.find("1")
    while position >= 0:
        positions.append(position)
        position = digits.find("1", position + 1)
    return positions


class ReplicaIndexObserver:
    """Forwards one replica pool's events to the global index (a ``KVCacheEventObserver``)."""

    __slots__ = ("index", "replica_id", "active")

    def __init__(self, index: GlobalPrefixIndex, replica_id: int) -> None:
        self.index = index
        self.replica_id = replica_id
        # False once observer_for gave the replica a new pool: this one's events are ignored.
        self.active = True

    def blocks_stored(self, block_hashes: list[BlockHash], block_ids: list[int]) -> None:
        if self.active:
            self.index.add_blocks(self.replica_id, block_hashes)

    def blocks_removed(self, block_hashes: list[BlockHash], block_ids: list[int]) -> None:
        if self.active:
            self.index.remove_blocks(self.replica_id, block_hashes)

    def all_blocks_cleared(self) -> None:
        if self.active:
            self.index.clear_replica(self.replica_id)
