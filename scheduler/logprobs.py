"""Log-probabilities of sampled tokens: one token's, and one step's as columns.

Only requests that ask (``SamplingParams.logprobs`` not ``None``) get them, so
a step's ``StepLogprobs`` names the sampled rows it covers::

    sampled_token_ids   [t0, t1, t2, t3]         (StepResult, one per sampled row)
    rows                [    1,      3]          the rows whose requests asked
    token_logprobs      [    l1,     l3]         their sampled tokens' logprobs
    num_top             [    2,      0]          alternatives per row
    top_token_ids       [    a b]                (flat, most likely first)
    top_logprobs        [    la lb]
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A sampled token's log-probability, and the most likely tokens at its position (most likely first).

    Log-probabilities are the model's own distribution: ``log_softmax`` of the
    raw logits in float32, before temperature, top-k, top-p or min-p.
    """

    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class StepLogprobs:
    """The logprobs of one step's sampled rows whose requests asked, as columns (see the module docstring).

    ``rows`` are indices into the step's sampled tokens, increasing; ``num_top[j]``
    alternatives of row ``rows[j]`` sit in ``top_token_ids`` and ``top_logprobs``
    after those of the rows before it.
    """

    rows: list[int]
    token_logprobs: list[float]
    num_top: list[int]
    top_token_ids: list[int]
    top_logprobs: list[float]

    def per_sampled_row(self, num_sampled: int) -> list[TokenLogprobs | None]:
        """One entry per sampled row: its ``TokenLogprobs``, or ``None`` where its request did not ask."""
        per_row: list[TokenLogprobs | None] = [None] * num_sampled
        offset = 0
        for row, logprob, num_top in zip(self.rows, self.token_logprobs, self.num_top, strict=True):
            end = offset + num_top
            per_row[row] = TokenLogprobs(
                logprob, tuple(self.top_token_ids[offset:end]), tuple(self.top_logprobs[offset:end])
            )
            offset = end
        return per_row


@dataclass(frozen=True, slots=True)
class StepPromptLogprobs:
    """The prompt logprobs one step computed (``kvserve.scheduler.prompt_logprobs``), as columns.

    ``rows`` are plan rows (``StepPlan.prompt_logprobs_rows``), increasing; row
    ``rows[j]`` covers ``num_positions[j]`` prompt tokens, from the one after its
    chunk's first position on, with ``num_top[j]`` alternatives at each.  The
    flat columns hold the rows one after the other: ``token_logprobs`` a value per
    position, ``top_token_ids`` and ``top_logprobs`` ``num_top`` per position.
    """

    rows: list[int]
    num_positions: list[int]
    num_top: list[int]
    token_logprobs: list[float]
    top_token_ids: list[int]
    top_logprobs: list[float]

    def per_row(self) -> list[tuple[int, list[TokenLogprobs]]]:
        """Each row and its positions' ``TokenLogprobs``, in order."""
        per_row = []
        position = top = 0
        for row, num_positions, num_top in zip(self.rows, self.num_positions, self.num_top, strict=True):
            logprobs = []
            for logprob in self.token_logprobs[position : position + num_positions]:
                logprobs.append(TokenLogprobs(
                    logprob, tuple(self.top_token_ids[top : top + num_top]), tuple(self.top_logprobs[top : top + num_top])
                ))
                top += num_top
            position += num_positions
            per_row.append((row, logprobs))
        return per_row
