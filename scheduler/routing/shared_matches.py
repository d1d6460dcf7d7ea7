"""Which prefix matches are shared: where prompts fork, not where one session's history ends.

A request's longest cached prefix ends at some block.  Where that block is
one an earlier prompt continued past (the earlier prompt went on with
other tokens: a second question after a document, a second user after a
customer's context), or where another request's match ended too, the prefix
is shared.  A chat turn's match ends where its own session's history ends:
at the end of the previous turn's answer, which no prompt continued past, so
it is private.

``SharedMatches`` remembers, for the blocks each routed prompt continued past
(its blocks after its match, but its last) and for the block its match ended
at, the request (counted in order) that last did so, and calls a match shared
when its end was seen within the last ``window`` requests.

Memory is bounded: every ``window`` requests, blocks last seen more than
``window`` requests ago are forgotten, so what is kept is about two windows'
worth of prompts' new blocks (amortised O(new blocks) per request).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.scheduler.block_hash import BlockHash
from kvserve.scheduler.checks import check_ints


class SharedMatches:
    """``observe(block_hashes, num_matched)`` per routed request: whether its match is shared."""

    def __init__(self, window: int, *, name: str = "window") -> None:
        """``name``: the argument ``window`` is reported as when invalid (the user's name for it)."""
        check_ints(1, **{name: window})
        self.window = window
        self._num_observed = 0
        self._last_pruned = 0
        self._last_seen: dict[BlockHash, int] = {}

    def observe(self, block_hashes: Sequence[BlockHash], num_matched: int) -> bool:
        """Record a prompt of ``block_hashes`` whose longest cached prefix is its first ``num_matched`` blocks.

        True if that prefix is shared: its last block was continued past by
        another prompt, or ended another match, within the last ``window``
        requests.  False for no match (``num_matched == 0``).
        """
        self._num_observed += 1
        now = self._num_observed
        last_seen = self._last_seen
        shared = False
        if num_matched:
            end = block_hashes[num_matched - 1]
            last = last_seen.get(end)
            shared = last is not None and now - last <= self.window
            last_seen[end] = now
        for block in block_hashes[num_matched:-1]:
            last_seen[block] = now
        if now - self._last_pruned >= self.window:
            self._last_pruned = now
            self._last_seen = {block: seen for block, seen in last_seen.items() if now - seen <= self.window}
        return shared

    def __len__(self) -> int:
        """Blocks remembered."""
        return len(self._last_seen)
