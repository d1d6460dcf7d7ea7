"""One request of a workload, as the simulator (or a load generator) replays it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """A request arriving at ``arrival_time`` seconds after the start of the run.

    ``output_len`` tokens are generated (EOS ignored).  ``output_token_ids``,
    when given, are the tokens the simulated model answers with: multi-turn
    workloads put them in the next turn's prompt, as a chat client would.
    ``group`` names what the request shares its prefix with (a prompt group,
    a session, a document), for analysis only.  ``measured`` is ``False`` for
    warm-up requests: served like the others, left out of the figures.
    """

    arrival_time: float
    prompt_token_ids: Sequence[int]
    output_len: int
    cache_salt: str | None = None
    output_token_ids: Sequence[int] | None = None
    group: str = ""
    measured: bool = True

    def __post_init__(self) -> None:
        if not self.arrival_time >= 0.0:
            raise ValueError(f"arrival_time must be >= 0, got {self.arrival_time}")
        if len(self.prompt_token_ids) == 0:
            raise ValueError("prompt_token_ids must not be empty")
        if isinstance(self.output_len, bool) or not isinstance(self.output_len, int) or self.output_len < 1:
            raise ValueError(f"output_len must be a positive integer, got {self.output_len!r}")
        if self.output_token_ids is not None and len(self.output_token_ids) != self.output_len:
            raise ValueError(
                f"output_token_ids has {len(self.output_token_ids)} tokens but output_len is {self.output_len}"
            )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
