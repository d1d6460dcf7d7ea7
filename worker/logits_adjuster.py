"""Changing a step's logits before sampling: penalties, biases and ``min_tokens``.

In vLLM's order, for the logit ``l[v]`` of token ``v`` of a request that has
generated ``v`` ``c[v]`` times so far::

    l[v] + logit_bias[v]                                   (1)
    divided by repetition_penalty where (1) > 0, multiplied by it where < 0,
        if v is in the prompt or c[v] > 0                  (2)
    (2) - frequency_penalty * c[v] - presence_penalty * (c[v] > 0)

(OpenAI's penalties count the generated tokens only; vLLM's and transformers'
repetition penalty counts the prompt too) and, while fewer than ``min_tokens``
tokens were generated, ``-inf`` for every token that would stop the request.

The counts ``c`` live on the device, a row of one ``[rows, vocab]`` int32 table
per request with a penalty, and each step's samples are added to them there:
a step never waits for its samples to reach the host before the next one is
planned (overlapped scheduling), and the counts are right even for a request
whose placeholder token the host has not seen yet.  A request that (re)starts
after a preemption, or on another replica, brings the tokens it generated before
(``NewRequestData.output_token_ids``) and counts on from there; one with a
repetition penalty brings its prompt too (``prompt_token_ids``: prefix-cache
hits skip cached prompt tokens on the worker), marked in a bool table whose
rows are the counts table's.

Only the worker that samples (rank 0) keeps an adjuster; a step in which no
request adjusts its logits pays one dictionary test.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.kernels.host_to_device import list_to_device
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.step_plan import StepPlan

_FLOAT32 = torch.finfo(torch.float32)


@dataclass(frozen=True, slots=True)
class _AdjustedRequest:
    """What one request's adjustments need across steps (its biases as lists, for ``extend``)."""

    params: SamplingParams
    count_row: int | None  # its row of the counts and prompt tables (penalties only)
    stop_token_ids: list[int]  # held back until min_tokens were generated
    bias_token_ids: list[int]
    biases: list[float]
    # NOTE: at least float32's smallest normal number: one that rounds to 0 would make 0 / 0 NaN.
    repetition_penalty: float


@dataclass(frozen=True, slots=True)
class StepAdjustments:
    """How to change the logits of one step's sampled rows, as device tensors.

    ``penalty_rows`` index the step's logits (and samples); ``count_rows`` are
    the same requests' rows of the counts table, ``counts`` a copy of them.
    ``repetition_penalties`` (1 for a request without one) and ``in_prompt``
    (the same rows of the prompt table) are set when some request has one.
    """

    penalty_rows: torch.Tensor | None = None
    count_rows: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    in_prompt: torch.Tensor | None = None
    bias_rows: torch.Tensor | None = None
    bias_token_ids: torch.Tensor | None = None
    biases: torch.Tensor | None = None
    banned_rows: torch.Tensor | None = None
    banned_token_ids: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (float32 ``[rows, vocab]``) adjusted in place."""
        if self.bias_rows is not None:
            logits.index_put_((self.bias_rows, self.bias_token_ids), self.biases, accumulate=True)
        if self.penalty_rows is not None:
            counts = self.counts
            generated = counts > 0
            penalty = counts.float() * self.frequency_penalties[:, None] + generated * self.presence_penalties[:, None]
            if self.repetition_penalties is None:
                logits.index_add_(0, self.penalty_rows, penalty, alpha=-1.0)
            else:
                rows = logits[self.penalty_rows]
                penalties = self.repetition_penalties[:, None]
                # NOTE: clamped: a penalty near 0 (or a huge one) takes logits past float32's range, and the
                # sampler's inf - inf is NaN.
                repeated = torch.where(rows < 0, rows * penalties, rows / penalties).clamp_(_FLOAT32.min, _FLOAT32.max)
                rows = torch.where(generated | self.in_prompt, repeated, rows)
                logits.index_copy_(0, self.penalty_rows, rows - penalty)
        if self.banned_rows is not None:
            # NOTE: new_full, not torch.tensor(-inf, device=...): a copy from pageable memory waits for the device.
            logits.index_put_((self.banned_rows, self.banned_token_ids), logits.new_full((), float("-inf")))
        return logits


class LogitsAdjuster:
    """The adjustments of one worker's running requests, kept from plan to plan.

    Call ``apply_plan`` with every plan (before its step samples), ``prepare`` for
    the step's sampled rows, then ``record`` with the step's samples.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._requests: dict[str, _AdjustedRequest] = {}
        self._counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self._in_prompt = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self._free_rows: list[int] = []

    @property
    def num_requests(self) -> int:
        """Running requests that adjust their logits."""
        return len(self._requests)

    def apply_plan(self, plan: StepPlan) -> None:
        """Forget the requests ``plan`` finishes or preempts; learn the ones it (re)starts."""
        requests = self._requests
        if requests:
            for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
                self._forget(req_id)
        for new in plan.new_requests:
            if requests:
                self._forget(new.req_id)  # restarted without a preemption notice
            params = new.sampling_params
            if not params.adjusts_logits:
                continue
            count_row = self._start_row(new.output_token_ids, new.prompt_token_ids) if params.has_penalties else None
            stop_token_ids = [t for t in new.stop_token_ids if 0 <= t < self.vocab_size]
            bias_token_ids = [token_id for token_id, _ in params.logit_bias]
            biases = [bias for _, bias in params.logit_bias]
            requests[new.req_id] = _AdjustedRequest(
                params, count_row, stop_token_ids, bias_token_ids, biases, max(params.repetition_penalty, _FLOAT32.tiny)
            )

    def prepare(self, req_ids: Sequence[str], output_indices: Sequence[int]) -> StepAdjustments | None:
        """The adjustments of a step that samples ``req_ids`` (its rows, in order), ``output_indices[i]``
        being the index of row ``i``'s token in its request's output; ``None`` when none adjusts."""
        requests = self._requests
        if not requests:
            return None
        penalty_rows: list[int] = []
        count_rows: list[int] = []
        presence: list[float] = []
        frequency: list[float] = []
        repetition: list[float] = []
        bias_rows: list[int] = []
        bias_token_ids: list[int] = []
        biases: list[float] = []
        banned_rows: list[int] = []
        banned_token_ids: list[int] = []
        for row, req_id in enumerate(req_ids):
            request = requests.get(req_id)
            if request is None:
                continue
            params = request.params
            if request.count_row is not None:
                penalty_rows.append(row)
                count_rows.append(request.count_row)
                presence.append(params.presence_penalty)
                frequency.append(params.frequency_penalty)
                repetition.append(request.repetition_penalty)
            if request.biases:
                bias_rows.extend([row] * len(request.biases))
                bias_token_ids.extend(request.bias_token_ids)
                biases.extend(request.biases)
            if output_indices[row] < params.min_tokens:
                banned_rows.extend([row] * len(request.stop_token_ids))
                banned_token_ids.extend(request.stop_token_ids)
        if not penalty_rows and not bias_rows and not banned_rows:
            return None
        device = self.device
        fields: dict[str, torch.Tensor] = {}
        if penalty_rows:
            count_index = list_to_device(count_rows, torch.int64, device)
            fields.update(
                penalty_rows=list_to_device(penalty_rows, torch.int64, device),
                count_rows=count_index,
                counts=self._counts[count_index],
                presence_penalties=list_to_device(presence, torch.float32, device),
                frequency_penalties=list_to_device(frequency, torch.float32, device),
            )
            if any(penalty != 1.0 for penalty in repetition):
                fields.update(
                    repetition_penalties=list_to_device(repetition, torch.float32, device),
                    in_prompt=self._in_prompt[count_index],
                )
        if bias_rows:
            fields.update(
                bias_rows=list_to_device(bias_rows, torch.int64, device),
                bias_token_ids=list_to_device(bias_token_ids, torch.int64, device),
                biases=list_to_device(biases, torch.float32, device),
            )
        if banned_rows:
            fields.update(
                banned_rows=list_to_device(banned_rows, torch.int64, device),
                banned_token_ids=list_to_device(banned_token_ids, torch.int64, device),
            )
        return StepAdjustments(**fields)

    def record(self, adjustments: StepAdjustments | None, token_ids: torch.Tensor) -> None:
        """Count the step's samples (``token_ids``, one per sampled row) for the penalized requests."""
        if adjustments is None or adjustments.count_rows is None:
            return
        sampled = token_ids[adjustments.penalty_rows]
        one = torch.ones((), dtype=torch.int32, device=self.device).expand(sampled.shape[0])
        self._counts.index_put_((adjustments.count_rows, sampled), one, accumulate=True)

    def _start_row(self, output_token_ids: Sequence[int], prompt_token_ids: Sequence[int]) -> int:
        """A free row, zeroed, of the counts table holding ``output_token_ids``' counts and of the prompt table
        marking ``prompt_token_ids``."""
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self._counts[row].zero_()
        self._in_prompt[row].zero_()
        if output_token_ids:
            token_ids = self._in_vocabulary(output_token_ids)
            # NOTE: not bincount, which reads the largest id back to the host (a sync on CUDA).
            ones = torch.ones((), dtype=torch.int32, device=self.device).expand(token_ids.shape[0])
            self._counts[row].index_add_(0, token_ids, ones)
        if prompt_token_ids:
            token_ids = self._in_vocabulary(prompt_token_ids)
            self._in_prompt[row].index_put_((token_ids,), self._in_prompt.new_ones(()))
        return row

    def _in_vocabulary(self, token_ids: Sequence[int]) -> torch.Tensor:
        return list_to_device([t for t in token_ids if 0 <= t < self.vocab_size], torch.int64, self.device)

    def _grow(self) -> None:
        num_rows = self._counts.shape[0]
        new_rows = max(4, 2 * num_rows)
        counts = torch.zeros((new_rows, self.vocab_size), dtype=torch.int32, device=self.device)
        counts[:num_rows] = self._counts
        in_prompt = torch.zeros((new_rows, self.vocab_size), dtype=torch.bool, device=self.device)
        in_prompt[:num_rows] = self._in_prompt
        self._counts, self._in_prompt = counts, in_prompt
        self._free_rows.extend(range(new_rows - 1, num_rows - 1, -1))

    def _forget(self, req_id: str) -> None:
        request = self._requests.pop(req_id, None)
        if request is not None and request.count_row is not None:
            self._free_rows.append(request.count_row)
