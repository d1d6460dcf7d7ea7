"""Stop strings: matched on a request's detokenized text as it streams, and never sent.

Text arrives in pieces (``IncrementalDetokenizer``'s), and a stop string may
span pieces, so the matcher holds back the end of the text that could still
be the start of a stop string::

    text so far:  "... and then</"      stop strings: ["</s>", "\\n\\n"]
    sent:         "... and then"        held back: "</" (a prefix of "</s>")

When a stop string is completed, the text before it is released and the rest is
dropped (of several, the one completed first wins: generation would have stopped
there); when the request ends without one, ``flush`` releases what was held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Bounds of one request's stop strings (every per-request size is bounded).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


def check_stop_strings(stop: Sequence[str]) -> None:
    """``ValueError`` naming the problem when ``stop`` is too long or holds an empty or overlong string."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for text in stop:
        if not text:
            raise ValueError("stop: a stop string is empty")
        if len(text) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop: a stop string is longer than {MAX_STOP_STRING_CHARS} characters")


def first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Where the stop string that ``text`` completes first starts (of two ending together, the longer).

    NOTE: the first completed, not the first started: generation stops as soon as one is produced.
    """
    found = [(i + len(s), i) for s in stop if (i := text.find(s)) >= 0]
    return min(found)[1] if found else None


class Detokenizer(Protocol):
    def add(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class StopStringMatcher:
    """Releases a stream's text up to its first stop string; ``stopped`` once one appeared."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = tuple(stop)
        self._held = ""
        self.stopped = False

    def add(self, text: str) -> str:
        """The text that can be sent now, ``text`` being the stream's next piece."""
        if self.stopped:
            return ""
        pending = self._held + text
        start = first_stop(pending, self._stop)
        if start is not None:
            self.stopped = True
            self._held = ""
            return pending[:start]
        hold = self._longest_partial_match(pending)
        self._held = pending[len(pending) - hold :] if hold else ""
        return pending[: len(pending) - hold]

    def flush(self) -> str:
        """What is held back, once the stream ended without a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_partial_match(self, text: str) -> int:
        """The length of the longest end of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def add_tokens(self, detokenizer: Detokenizer, token_ids: Sequence[int], *, is_last: bool) -> tuple[str, int]:
        """The text to send of ``token_ids``, decoded one by one, and how many of them were produced before
        the stop: all of them, or those up to the one that completed a stop string."""
        pieces = []
        for num_used, token_id in enumerate(token_ids, start=1):
            pieces.append(self.add(detokenizer.add([token_id])))
            if self.stopped:
                return "".join(pieces), num_used
        if is_last:
            pieces.append(self.add(detokenizer.flush()))
            pieces.append(self.flush())
        return "".join(pieces), len(token_ids)
