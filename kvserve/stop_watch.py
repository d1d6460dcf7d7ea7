"""Stop strings for the in-process ``LLM``: each watched request's text as it is produced, and
where it stopped.

The servers' front end matches ``SamplingParams.stop`` on the text it streams; ``LLM`` has no
stream, so it feeds each request's tokens, as the steps produce them, through the same
detokenizer and matcher (``kvserve.scheduler.stop_strings``).  When one completes a stop
string, ``LLM`` aborts the request: the tokens up to that one are its output, the text before
the stop string its text, and ``"stop"`` its finish reason::

    tokens  "Once" " upon" " a" "\n" ...     stop ["\n"]
    output  4 tokens, text "Once upon a", finish reason "stop"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.cluster.detokenizer import IncrementalDetokenizer
from kvserve.scheduler.request import Request
from kvserve.scheduler.request_output import RequestOutput
from kvserve.scheduler.stop_strings import StopStringMatcher


@dataclass(slots=True)
class _Watched:
    matcher: StopStringMatcher
    detokenizer: IncrementalDetokenizer
    pieces: list[str] = field(default_factory=list)


class StopWatch:
    """The requests of one ``generate`` call that have stop strings."""

    def __init__(self, tokenizer: Any | None) -> None:
        self._tokenizer = tokenizer
        self._watched: dict[str, _Watched] = {}

    def watch(self, request: Request) -> None:
        """Follow ``request`` if it has stop strings; ``ValueError`` if it has and there is no tokenizer."""
        params = request.sampling_params
        if not params.stop:
            return
        if self._tokenizer is None:
            raise ValueError("stop strings need the detokenized text, and this model has no tokenizer")
        self._watched[request.req_id] = _Watched(
            StopStringMatcher(params.stop, params.min_tokens), IncrementalDetokenizer(self._tokenizer)
        )

    def stops(self, output: RequestOutput) -> bool:
        """Take in one step's token of a request; ``True`` when it completed a stop string: the
        request ends with it (aborted, the scheduler gives it no later token)."""
        watched = self._watched.get(output.req_id)
        if watched is None:
            return False
        text, _ = watched.matcher.add_tokens(watched.detokenizer, [output.token_id], is_last=output.finished)
        watched.pieces.append(text)
        return watched.matcher.stopped

    def stopped(self, req_id: str) -> bool:
        """Whether a stop string ended the request."""
        watched = self._watched.get(req_id)
        return watched is not None and watched.matcher.stopped

    def text(self, req_id: str) -> str | None:
        """A watched request's text, up to its stop string; ``None`` for a request not watched."""
        watched = self._watched.get(req_id)
        return "".join(watched.pieces) if watched is not None else None
