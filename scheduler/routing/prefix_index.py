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
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.scheduler.block_hash import BlockHash


class GlobalPrefixIndex:
    """Which replicas cache which blocks, from every replica pool's events."""

    __slots__ = ("_holders", "_copies", "_observers")

    def __init__(self) -> None:
        # hash -> bit mask of the replicas holding at least one copy.
        self._holders: dict[BlockHash, int] = {}
        # replica -> hash -> number of its cached blocks with that hash.
        self._copies: dict[int, dict[BlockHash, int]] = {}
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
        """Forget every block of ``replica_id`` (its pool reset its prefix cache)."""
        copies = self._copies.get(replica_id)
        if not copies:
            return
        for block_hash in copies:
            _drop_bit(self._holders, block_hash, replica_id)
        copies.clear()

    # -- queries -----------------------------------------------------------------

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[int, int]:
        """Replica -> number of leading blocks of ``block_hashes`` it caches.

        Replicas that cache not even the first block are absent.  One walk of
        the chain: the candidate mask only shrinks and the walk stops when it
        is empty.
        """
        if not block_hashes:
            return {}
        holders_of = self._holders.get
        candidates = holders_of(block_hashes[0], 0)
        if not candidates:
            return {}
        matched: dict[int, int] = {}
        num_blocks = len(block_hashes)
        for position in range(1, num_blocks):
            block_hash = block_hashes[position]
            replicas = holders_of(block_hash, 0)
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

    def num_leading_blocks(self, replica_id: int, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``block_hashes`` replica ``replica_id`` caches (one replica's ``match``)."""
        copies = self._copies.get(replica_id)
        if not copies:
            return 0
        num_blocks = 0
        for block_hash in block_hashes:
            if block_hash not in copies:
                break
            num_blocks += 1
        return num_blocks

    def replicas_holding(self, block_hash: BlockHash) -> frozenset[int]:
        return frozenset(_bits(self._holders.get(block_hash, 0)))

    def num_copies(self, replica_id: int, block_hash: BlockHash) -> int:
        """Cached blocks of ``replica_id`` whose hash is ``block_hash``."""
        return self._copies.get(replica_id, {}).get(block_hash, 0)

    def num_blocks(self, replica_id: int) -> int:
        """Distinct block hashes ``replica_id`` caches."""
        return len(self._copies.get(replica_id, ()))

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
