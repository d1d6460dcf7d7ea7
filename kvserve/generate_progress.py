"""Progress of one ``LLM.generate`` call: requests finished, tokens generated, tokens per second.

A call over thousands of prompts runs for minutes; without a word it looks hung.  By
default (``progress=None``) the progress shows only where someone watches: on a terminal
(the stream is a TTY), and only once the call has run ``DELAY_S``, so short calls and
logs stay quiet.  ``progress=True`` shows it on any stream from the start (a line per
``INTERVAL_S`` in a log, one rewritten line on a terminal), ``False`` never.  The last
line says what the call did in all::

    generate: 256/256 requests, 32,768 tokens in 9.5 s (3,449 tok/s)
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

# A call shorter than this shows no progress unless asked to (``progress=True``).
DELAY_S = 2.0
# At most one line (or rewrite) per this many seconds.
INTERVAL_S = 0.5


class GenerateProgress:
    """Reports ``update``'s counts on ``stream`` (default ``sys.stderr``), as the module docstring says."""

    def __init__(self, num_requests: int, show: bool | None, stream: TextIO | None = None) -> None:
        self.num_requests = num_requests
        self._stream = sys.stderr if stream is None else stream
        self._tty = _is_tty(self._stream)
        self._enabled = self._tty if show is None else show
        self._asked = show is True  # the totals at the end even when nothing was shown before
        self._start = time.monotonic()
        self._next_s = self._start + (DELAY_S if show is None else 0.0)
        self._shown = False
        self._num_finished = 0
        self._num_tokens = 0

    def update(self, num_finished: int, num_tokens: int) -> None:
        """``num_finished`` requests of the call ended and ``num_tokens`` were generated, so far."""
        self._num_finished, self._num_tokens = num_finished, num_tokens
        if not self._enabled:
            return
        now = time.monotonic()
        if now >= self._next_s:
            self._next_s = now + INTERVAL_S
            self._write(now, final=False)

    def close(self) -> None:
        """The call ended: its totals, if any progress was shown (or asked for)."""
        if self._enabled and (self._shown or self._asked):
            self._write(time.monotonic(), final=True)

    def _write(self, now: float, *, final: bool) -> None:
        elapsed_s = now - self._start
        rate = self._num_tokens / elapsed_s if elapsed_s > 0 else 0.0
        line = (
            f"generate: {self._num_finished}/{self.num_requests} requests, {self._num_tokens:,} tokens "
            f"in {elapsed_s:.1f} s ({rate:,.0f} tok/s)"
        )
        if self._tty:
            self._stream.write(f"\r\033[K{line}" + ("\n" if final else ""))
        else:
            self._stream.write(line + "\n")
        self._stream.flush()
        self._shown = True


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream
        return False
