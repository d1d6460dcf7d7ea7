"""Prompt logprobs on the worker: those of the prompt tokens that a step's chunks predict.

Which chunks, and which of their positions, is the scheduler's choice
(``kvserve.scheduler.prompt_logprobs``): a row of ``plan.prompt_logprobs_rows``
over positions ``[s, e)`` of a prompt of ``P`` tokens predicts the tokens at
``s + 1 .. min(e, P - 1)``; those are the row's own tokens after its first, and,
when the prompt goes on past the chunk, ``plan.next_prompt_token_ids``' next.

The logits of those positions are computed in slices (a long chunk's logits over
a large vocabulary would take gigabytes at once), by every rank, since the
vocabulary-parallel head gathers across ranks; rank 0 keeps the logprobs, on the
device, for the step's one copy to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.kernels.host_to_device import to_device
from kvserve.scheduler.logprobs import StepPromptLogprobs
from kvserve.scheduler.step_plan import StepPlan
from kvserve.worker.input_batch import CachedRequestState

# The most logits computed at once (a vocabulary of 128k: 256 positions, 128 MiB of float32).
MAX_LOGITS_AT_ONCE = 2**25


@dataclass(frozen=True, slots=True)
class PromptLogprobsOnDevice:
    """A step's prompt logprobs, packed on the device as float64: each position's token logprob, then the
    ``width`` best logprobs of each position, then their token ids (float64 holds int32 ids exactly)."""

    rows: list[int]
    num_positions: list[int]
    num_top: list[int]
    width: int
    packed: torch.Tensor

    def unpack(self, packed: torch.Tensor) -> StepPromptLogprobs:
        """The columns of ``packed`` (this on the host), each position's first ``num_top`` alternatives kept."""
        values = packed.numpy()
        num = sum(self.num_positions)
        token_logprobs, top_logprobs, top_token_ids = np.split(values, [num, num + num * self.width])
        top_of_position = np.repeat(np.asarray(self.num_top, dtype=np.int64), self.num_positions)
        keep = np.arange(self.width)[None, :] < top_of_position[:, None]
        return StepPromptLogprobs(
            rows=list(self.rows),
            num_positions=list(self.num_positions),
            num_top=list(self.num_top),
            token_logprobs=token_logprobs.tolist(),
            top_token_ids=top_token_ids.reshape(num, self.width)[keep].astype(np.int64).tolist(),
            top_logprobs=top_logprobs.reshape(num, self.width)[keep].tolist(),
        )


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
    plan: StepPlan,
    states: Sequence[CachedRequestState],
    query_start_loc: Sequence[int],
    *,
    vocab_size: int,
    keep: bool,
) -> PromptLogprobsOnDevice | None:
    """The prompt logprobs of ``plan``'s prompt-logprobs rows, from the step's ``hidden_states`` (a row's
    tokens start at ``query_start_loc[row]``; ``states[row]`` is its request's).  Every rank calls this;
    only the one that ``keep``s gets them, the others ``None``.  ``ValueError`` for an inconsistent plan."""
    rows = plan.prompt_logprobs_rows
    next_tokens = iter(plan.next_prompt_token_ids)
    index: list[int] = []
    targets: list[int] = []
    num_positions: list[int] = []
    num_top: list[int] = []
    for row in rows:
        state = states[row]
        start = plan.num_computed_tokens[row]
        end = start + plan.num_scheduled_tokens[row]
        last = min(end, state.num_prompt_tokens - 1)  # positions start .. last - 1 predict start + 1 .. last
        if state.sampling_params.prompt_logprobs is None or last <= start:
            raise ValueError(f"step {plan.step_id}: row {row} ({plan.req_ids[row]!r}) has no prompt logprobs to give")
        first = query_start_loc[row]
        chunk = plan.token_ids[first : first + end - start]
        index.extend(range(first, first + last - start))
        targets.extend(chunk[1 : last - start + 1])
        if last == end:  # the last target is the token after the chunk
            token_id = next(next_tokens, None)
            if token_id is None:
                raise ValueError(f"step {plan.step_id}: next_prompt_token_ids is short of the chunks that need one")
            targets.append(token_id)
        num_positions.append(last - start)
        num_top.append(state.sampling_params.prompt_logprobs)
    if next(next_tokens, None) is not None:
        raise ValueError(f"step {plan.step_id}: next_prompt_token_ids has more tokens than chunks that need one")
    device = hidden_states.device
    index_on_device = to_device(np.asarray(index, dtype=np.int64), device)
    targets_on_device = to_device(np.asarray(targets, dtype=np.int64), device)
    width = min(max(num_top), vocab_size)
    slice_size = max(1, MAX_LOGITS_AT_ONCE // vocab_size)
    token_logprobs, top_logprobs, top_token_ids = [], [], []
    for begin in range(0, len(index), slice_size):
        logits = compute_logits(hidden_states[index_on_device[begin : begin + slice_size]])
        if not keep:
            continue
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        token_logprobs.append(logprobs.gather(-1, targets_on_device[begin : begin + slice_size, None]).squeeze(-1))
        best_logprobs, best_ids = logprobs.topk(width, dim=-1)
        top_logprobs.append(best_logprobs)
        top_token_ids.append(best_ids)
    if not keep:
        return None
    packed = torch.cat([
        torch.cat(token_logprobs).double(),
        torch.cat(top_logprobs).double().flatten(),
        torch.cat(top_token_ids).double().flatten(),
    ])
    return PromptLogprobsOnDevice(list(rows), num_positions, [min(k, width) for k in num_top], width, packed)
