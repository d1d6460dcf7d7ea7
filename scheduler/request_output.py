"""What one step produced for one request."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.scheduler.logprobs import TokenLogprobs
from kvserve.scheduler.request import FinishReason


# NOTE: not frozen: one is built per request per step, and a frozen dataclass's
# __init__ (object.__setattr__ per field) costs several times more.
@dataclass(slots=True)
class RequestOutput:
    """A token sampled for ``req_id`` in one step; ``finish_reason`` is set when it was the last.

    ``logprobs`` is set when the request asked for them (``SamplingParams.logprobs``).
    """

    req_id: str
    token_id: int
    finish_reason: FinishReason | None = None
    logprobs: TokenLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
