"""Stop strings: matched on a request's detokenized text as it streams, and never sent.

Text arrives in pieces (``IncrementalDetokenizer``'s), and a stop string may
span pieces, so the matcher holds back the end of the text that could still
be the start of a stop string::

    text so far:  "... and then</"      stop strings: ["</s>", "\\n\\n"]
    sent:         "... and then"        held back: "</" (a prefix of "</s>")

When a stop string is completed, the text before it is released and the rest is
dropped (of several, the one completed first wins: generation would have stopped
there); when the request ends without one, ``flush`` releases what was held.

``min_tokens``: a stop string ends the stream only if it ends in text of the
tokens after the first ``min_tokens`` (it may begin earlier).  The text of
those first tokens, as the detokenizer releases it, is sent even where it holds
a whole stop string (vLLM's rule: stop strings are checked once the output has
more than ``min_tokens`` tokens, and only in the text those tokens add)::

    min_tokens 2, stop ["ab"]:  tokens "ab" "c" "ab" "d"  ->  sent "abc"   (the first "ab" ends in token 1)
                                tokens "xa" "b" "c"       ->  sent "xabc"  ("ab" ends in token 2)
                                tokens "x" "a" "b"        ->  sent "x"     ("ab" ends in token 3)
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


def first_stop(text: str, stop: Sequence[str], may_end_after: int = 0) -> int | None:
    """Where the stop string that ``text`` completes first starts (of two ending together, the longer),
    among those that end after its first ``may_end_after`` characters.

    NOTE: the first completed, not the first started: generation stops as soon as one is produced.
    """
    # An occurrence at i ends at i + len(s), past may_end_after exactly when i >= may_end_after - len(s) + 1.
    found = [(i + len(s), i) for s in stop if (i := text.find(s, max(0, may_end_after - len(s) + 1))) >= 0]
    return min(found)[1] if found else None


class Detokenizer(Protocol):
    def add(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class StopStringMatcher:
    """Releases a stream's text up to its first stop string; ``stopped`` once one appeared.

    ``min_tokens``: the first that many tokens fed to ``add_tokens`` cannot end a stop string.
    """

    def __init__(self, stop: Sequence[str], min_tokens: int = 0) -> None:
        self._stop = tuple(stop)
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._held = ""
        # How many of the held characters, at its start, came from text that may not end a stop string.
        self._num_held_protected = 0
        self.stopped = False

    def add(self, text: str, *, may_stop: bool = True) -> str:
        """The text that can be sent now, ``text`` being the stream's next piece.

        ``may_stop=False``: no stop string may end in ``text`` (the text of the first ``min_tokens``
        tokens); such pieces must all come before the others.
        """
        if self.stopped:
            return ""
        pending = self._held + text
        num_protected = self._num_held_protected + (0 if may_stop else len(text))
        start = first_stop(pending, self._stop, num_protected)
        if start is not None:
            self.stopped = True
            self._held = ""
            self._num_held_protected = 0
            return pending[:start]
        hold = self._longest_partial_match(pending)
        num_sent = len(pending) - hold
        self._held = pending[num_sent:]
        self._num_held_protected = max(0, num_protected - num_sent)
        return pending[:num_sent]

    def flush(self) -> str:
        """What is held back, once the stream ended without a stop string."""
        held, self._held = self._held, ""
        self._num_held_protected = 0
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
        the stop: all of them, or those up to the one that completed a stop string.

        The stream's tokens are counted across calls: the text of its first ``min_tokens`` cannot end a
        stop string.
        """
        pieces = []
        for num_used, token_id in enumerate(token_ids, start=1):
            self._num_tokens += 1
            pieces.append(self.add(detokenizer.add([token_id]), may_stop=self._num_tokens > self._min_tokens))
            if self.stopped:
                return "".join(pieces), num_used
        if is_last:
            # The detokenizer's last text belongs to the last token.
            pieces.append(self.add(detokenizer.flush(), may_stop=self._num_tokens > self._min_tokens))
            pieces.append(self.flush())
        return "".join(pieces), len(token_ids)
