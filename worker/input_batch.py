"""Turning a ``StepPlan`` into the tensors of one forward pass.

The worker keeps, per request, what the plan sent once (sampling
parameters, prompt length) and its block table, which each plan extends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.kernels import AttentionMetadata, build_attention_metadata
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.step_plan import StepPlan


@dataclass(slots=True)
class CachedRequestState:
    """A worker's memory of one running request."""

    sampling_params: SamplingParams
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ModelInputs:
    """Everything one forward pass and its sampling need."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    # Rows of the hidden states whose logits are sampled, in plan order.
    logits_indices: torch.Tensor
    sampling_params: list[SamplingParams]
    # Index of the sampled token within its request's output (0 = first).
    output_indices: list[int]


class InputBatch:
    """The per-request state of one worker, updated by every plan."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.requests: dict[str, CachedRequestState] = {}

    def apply(self, plan: StepPlan) -> None:
        """Drop finished/preempted requests, start new ones, extend block tables."""
        requests = self.requests
        for req_id in plan.finished_req_ids:
            requests.pop(req_id, None)
        for req_id in plan.preempted_req_ids:
            requests.pop(req_id, None)
        for new in plan.new_requests:
            requests[new.req_id] = CachedRequestState(new.sampling_params, new.num_prompt_tokens)
        offset = 0
        new_block_ids = plan.new_block_ids
        for req_id, count in zip(plan.req_ids, plan.num_new_block_ids):
            if count:
                state = requests.get(req_id)
                if state is None:
                    raise ValueError(f"step {plan.step_id} extends unknown request {req_id!r}")
                state.block_ids.extend(new_block_ids[offset : offset + count])
                offset += count

    def prepare(self, plan: StepPlan) -> ModelInputs:
        """Tensors for ``plan``; call ``apply(plan)`` first."""
        requests = self.requests
        try:
            states = [requests[req_id] for req_id in plan.req_ids]
        except KeyError as exc:
            raise ValueError(f"step {plan.step_id} schedules unknown request {exc.args[0]!r}") from None
        query_lens = np.asarray(plan.num_scheduled_tokens, dtype=np.int64)
        starts = np.asarray(plan.num_computed_tokens, dtype=np.int64)
        seq_lens = starts + query_lens
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        positions = np.arange(total, dtype=np.int64) + np.repeat(starts - query_start_loc[:-1], query_lens)
        attn_metadata = build_attention_metadata(
            query_lens.tolist(),
            seq_lens.tolist(),
            [state.block_ids for state in states],
            self.block_size,
            self.device,
        )
        sample_rows = [i for i, sample in enumerate(plan.sample) if sample]
        logits_indices = query_start_loc[1:][sample_rows] - 1
        device = self.device
        return ModelInputs(
            input_ids=torch.tensor(plan.token_ids, dtype=torch.long, device=device),
            positions=torch.from_numpy(positions).to(device),
            attn_metadata=attn_metadata,
            logits_indices=torch.from_numpy(logits_indices).to(device),
            sampling_params=[states[i].sampling_params for i in sample_rows],
            output_indices=[int(seq_lens[i]) - states[i].num_prompt_tokens for i in sample_rows],
        )
