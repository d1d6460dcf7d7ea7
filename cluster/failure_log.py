"""Logging the requests that failed: every one at DEBUG, one WARNING per burst and reason.

A replica's death fails every request it was computing within milliseconds, up to
``max_concurrent_requests`` of them, mostly for one reason: a WARNING each was a
thousand lines at once.
"""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger("kvserve.cluster.frontend")


class FailureLog:
    """The log lines of failed requests: each one's at DEBUG at once, and one WARNING per burst and reason.

    A burst is the first failure and those in the ``window_s`` after it; its WARNING (at its
    end, or at ``flush``) gives, per ``what`` and ``internals``, the number of requests and
    the first few ids, for at most ``MAX_REASONS`` reasons (then one line for the rest).
    NOTE: a replica's death fails every request it was computing within milliseconds, up to
    ``max_concurrent_requests`` of them, mostly for one reason.
    """

    NUM_EXAMPLE_IDS = 64
    MAX_REASONS = 4

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._req_ids: dict[tuple[str, str], list[str]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, req_id: str, what: str, internals: str) -> None:
        """Log that ``req_id`` failed: ``what`` (as its client was told) because of ``internals``."""
        logger.debug("request %s: %s: %s", req_id, what, internals)
        self._req_ids.setdefault((what, internals), []).append(req_id)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.window_s, self.flush)

    def flush(self) -> None:
        """Log the burst so far now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        by_reason, self._req_ids = self._req_ids, {}
        reasons = sorted(by_reason.items(), key=lambda item: len(item[1]), reverse=True)
        for (what, internals), req_ids in reasons[: self.MAX_REASONS]:
            if len(req_ids) == 1:
                logger.warning("request %s: %s: %s", req_ids[0], what, internals)
                continue
            examples = ", ".join(req_ids[: self.NUM_EXAMPLE_IDS])
            if len(req_ids) > self.NUM_EXAMPLE_IDS:
                examples += f" and {len(req_ids) - self.NUM_EXAMPLE_IDS} more (every id at DEBUG)"
            logger.warning("%d requests (%s): %s: %s", len(req_ids), examples, what, internals)
        if rest := reasons[self.MAX_REASONS :]:
            num_requests = sum(len(req_ids) for _, req_ids in rest)
            logger.warning("%d more requests failed for %d other reasons (each at DEBUG)", num_requests, len(rest))
