"""Turning a ``StepPlan`` into the tensors of one forward pass.

The worker keeps, per request, what the plan sent once (sampling
parameters, prompt length) and its block table.  Block tables live in one
persistent numpy array, a row per request, so a step costs O(what changed)
rather than O(context)::

    block_table  row 0: [ 7  8  9  0  0 ]   num_blocks[0] = 3
                 row 1: [ 4  0  0  0  0 ]   num_blocks[1] = 1
                 row 2: (free)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.kernels import AttentionMetadata
from kvserve.kernels.attention_metadata import attention_metadata_from_arrays
from kvserve.kernels.host_to_device import to_device
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.step_plan import StepPlan
from kvserve.worker.device_block_table import DeviceBlockTable


@dataclass(slots=True)
class CachedRequestState:
    """A worker's memory of one running request: its parameters and its block-table row."""

    sampling_params: SamplingParams
    num_prompt_tokens: int
    row: int


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
    # Each scheduled request's state, in plan order.
    states: list[CachedRequestState]


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """Host arrays of a step in which every request has exactly one new token.

    Such a step can replay a CUDA graph: its inputs are these arrays, copied into
    the graph's static buffers, and the block-table ``rows`` gathered from the
    device mirror of the block table.
    """

    input_ids: np.ndarray  # int64 [n]
    positions: np.ndarray  # int64 [n]
    slot_mapping: np.ndarray  # int64 [n]
    seq_lens: np.ndarray  # int32 [n], context after this step (position + 1)
    rows: np.ndarray  # int64 [n], each request's row of the block table
    logits_indices: np.ndarray  # int64, the requests whose token is sampled, in plan order
    sampling_params: list[SamplingParams]
    output_indices: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.input_ids)

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max(initial=0))


class InputBatch:
    """The per-request state of one worker, updated by every plan.

    With ``max_blocks_per_req`` the block table is mirrored on the device as well
    (:class:`DeviceBlockTable`), which the CUDA-graph path reads.
    """

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        initial_rows: int = 64,
        initial_blocks: int = 64,
        *,
        max_blocks_per_req: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.device = device
        self.requests: dict[str, CachedRequestState] = {}
        self.block_table = np.zeros((initial_rows, initial_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(initial_rows, dtype=np.int64)
        self._free_rows = list(range(initial_rows - 1, -1, -1))
        self.device_block_table = (
            DeviceBlockTable(initial_rows, max_blocks_per_req, device) if max_blocks_per_req is not None else None
        )

    def block_ids(self, req_id: str) -> list[int]:
        row = self.requests[req_id].row
        return self.block_table[row, : self.num_blocks[row]].tolist()

    def apply(self, plan: StepPlan) -> None:
        """Drop finished/preempted requests, start new ones, extend block tables."""
        requests = self.requests
        for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
            state = requests.pop(req_id, None)
            if state is not None:
                self._release_row(state.row)
        for new in plan.new_requests:
            old = requests.pop(new.req_id, None)
            if old is not None:  # restarted without a preemption notice: start afresh
                self._release_row(old.row)
            requests[new.req_id] = CachedRequestState(new.sampling_params, new.num_prompt_tokens, self._take_row())
        counts = np.asarray(plan.num_new_block_ids, dtype=np.int64)
        extended = np.flatnonzero(counts)
        if extended.size == 0:
            return
        try:
            rows = np.fromiter(
                (requests[plan.req_ids[i]].row for i in extended.tolist()), dtype=np.int64, count=extended.size
            )
        except KeyError as exc:
            raise ValueError(f"step {plan.step_id} extends unknown request {exc.args[0]!r}") from None
        # One scatter for every request's new blocks: row r gets its ids at
        # columns num_blocks[r] onward.
        counts = counts[extended]
        starts = self.num_blocks[rows]
        ends = starts + counts
        if int(ends.max()) > self.block_table.shape[1]:
            self._grow_columns(int(ends.max()))
        first_flat = np.cumsum(counts) - counts
        columns = np.arange(int(counts.sum())) + np.repeat(starts - first_flat, counts)
        scatter_rows = np.repeat(rows, counts)
        new_block_ids = np.asarray(plan.new_block_ids, dtype=np.int32)
        self.block_table[scatter_rows, columns] = new_block_ids
        self.num_blocks[rows] = ends
        if self.device_block_table is not None:
            self.device_block_table.write(scatter_rows, columns, new_block_ids)

    def prepare_decode(self, plan: StepPlan) -> DecodeBatch | None:
        """The host arrays of ``plan`` when every request has one new token, else ``None``.

        Call ``apply(plan)`` first.  A request's single token may also be the last
        of its prompt: attention treats both alike.
        """
        num_reqs = len(plan.req_ids)
        if num_reqs == 0 or len(plan.token_ids) != num_reqs:
            return None
        states, rows = self._states_and_rows(plan)
        positions = np.asarray(plan.num_computed_tokens, dtype=np.int64)
        block_index = positions // self.block_size
        short = np.flatnonzero(block_index >= self.num_blocks[rows])
        if short.size:
            r = int(short[0])
            raise ValueError(
                f"step {plan.step_id}: request {plan.req_ids[r]!r} at position {positions[r]} has only "
                f"{self.num_blocks[rows[r]]} blocks of {self.block_size}"
            )
        block_ids = self.block_table[rows, block_index].astype(np.int64)
        seq_lens = positions + 1
        sample_rows, sampling_params, output_indices = _sampled_rows(plan, states, seq_lens.tolist())
        return DecodeBatch(
            input_ids=np.asarray(plan.token_ids, dtype=np.int64),
            positions=positions,
            slot_mapping=block_ids * self.block_size + positions % self.block_size,
            seq_lens=seq_lens.astype(np.int32),
            rows=rows,
            logits_indices=np.asarray(sample_rows, dtype=np.int64),
            sampling_params=sampling_params,
            output_indices=output_indices,
        )

    def prepare(self, plan: StepPlan) -> ModelInputs:
        """Tensors for ``plan``; call ``apply(plan)`` first."""
        states, rows = self._states_and_rows(plan)
        query_lens = np.asarray(plan.num_scheduled_tokens, dtype=np.int64)
        starts = np.asarray(plan.num_computed_tokens, dtype=np.int64)
        seq_lens = starts + query_lens
        num_blocks = self.num_blocks[rows]
        width = int(num_blocks.max(initial=0))
        attn_metadata = attention_metadata_from_arrays(
            query_lens, seq_lens, self.block_table[rows, :width], self.block_size, self.device,
            num_blocks=num_blocks,
        )
        query_start_loc = np.asarray(attn_metadata.query_start_loc_cpu, dtype=np.int64)
        total = int(query_start_loc[-1])
        positions = np.arange(total, dtype=np.int64) + np.repeat(starts - query_start_loc[:-1], query_lens)
        # NOTE: the metadata's tuple of ints, not numpy scalars, for the output indices.
        sample_rows, sampling_params, output_indices = _sampled_rows(plan, states, attn_metadata.seq_lens_cpu)
        logits_indices = query_start_loc[1:][sample_rows] - 1
        device = self.device
        return ModelInputs(
            input_ids=to_device(np.asarray(plan.token_ids, dtype=np.int64), device),
            positions=to_device(positions, device),
            attn_metadata=attn_metadata,
            logits_indices=to_device(logits_indices, device),
            sampling_params=sampling_params,
            output_indices=output_indices,
            states=states,
        )

    def _states_and_rows(self, plan: StepPlan) -> tuple[list[CachedRequestState], np.ndarray]:
        """The state of each request ``plan`` schedules, and its block-table row."""
        requests = self.requests
        try:
            states = [requests[req_id] for req_id in plan.req_ids]
        except KeyError as exc:
            raise ValueError(f"step {plan.step_id} schedules unknown request {exc.args[0]!r}") from None
        return states, np.fromiter((state.row for state in states), dtype=np.int64, count=len(states))

    def _release_row(self, row: int) -> None:
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def _take_row(self) -> int:
        if not self._free_rows:
            num_rows = self.block_table.shape[0]
            self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self._free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        return self._free_rows.pop()

    def _grow_columns(self, min_columns: int) -> None:
        columns = self.block_table.shape[1]
        while columns < min_columns:
            columns *= 2
        grown = np.zeros((self.block_table.shape[0], columns), dtype=np.int32)
        grown[:, : self.block_table.shape[1]] = self.block_table
        self.block_table = grown


def _sampled_rows(
    plan: StepPlan, states: list[CachedRequestState], seq_lens: Sequence[int]
) -> tuple[list[int], list[SamplingParams], list[int]]:
    """The rows ``plan`` samples, their sampling parameters, and the index of each sampled token
    within its request's output (``seq_lens``: each row's context after the step)."""
    sample_rows = [i for i, sample in enumerate(plan.sample) if sample]
    return (
        sample_rows,
        [states[i].sampling_params for i in sample_rows],
        [seq_lens[i] - states[i].num_prompt_tokens for i in sample_rows],
    )
