"""Which prefix matches are shared: another recent request's match ended at the same block.

A request's longest cached prefix ends at some block.  Requests that share a
prefix (a system prompt, a customer's context, a document) have their matches
end at the same block again and again; a chat turn's match ends where its own
session's history ends, a block no other request's match ends at.
``SharedMatches`` remembers, for each block some request's match ended at,
the request (counted in order) it last was, and calls a match shared when
another ended at its block within the last ``window`` requests.

Memory is bounded: once more than ``2 * window`` blocks are remembered, those
last seen more than ``window`` requests ago are forgotten (amortised O(1) per
request).
"""

from __future__ import annotations

from kvserve.scheduler.block_hash import BlockHash
from kvserve.scheduler.checks import check_ints


class SharedMatches:
    """``observe(end)`` per routed request whose prompt matched; it says whether ``end`` was shared."""

    def __init__(self, window: int, *, name: str = "window") -> None:
        """``name``: the argument ``window`` is reported as when invalid (the user's name for it)."""
        check_ints(1, **{name: window})
        self.window = window
        self._num_observed = 0
        self._last_seen: dict[BlockHash, int] = {}

    def observe(self, end: BlockHash) -> bool:
        """Record a match ending at block ``end``; True if another ended there within the last ``window``."""
        self._num_observed += 1
        now = self._num_observed
        last = self._last_seen.get(end)
        self._last_seen[end] = now
        if len(self._last_seen) > 2 * self.window:
            self._last_seen = {block: seen for block, seen in self._last_seen.items() if now - seen <= self.window}
        return last is not None and now - last <= self.window

    def __len__(self) -> int:
        """Blocks remembered (at most ``2 * window + 1``)."""
        return len(self._last_seen)
