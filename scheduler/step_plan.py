"""The scheduler's output for one step: everything the workers need, nothing more.

Workers keep per-request state (block table, sampling parameters) across
steps, so a plan carries only what changed.  Per-request fields are parallel,
columnar lists in batch order, and variable-length ones are flattened, so that
the wire format can pack each as one array of bytes::

    req_ids               [r0,      r1,   r2]
    num_scheduled_tokens  [3,       1,    1]
    token_ids             [t t t,   t,    t]          (flat, 5 ids)
    num_new_block_ids     [2,       0,    1]
    new_block_ids         [b b,           b]          (flat, 3 ids)

A request's block table on the worker is the concatenation of every
``new_block_ids`` it was sent since it last appeared in ``new_requests``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """What a worker learns once, when a request is first scheduled or resumed.

    A resumed (previously preempted) request starts over with an empty block
    table; ``num_prompt_tokens`` lets the worker number its output tokens.

    What only logits adjustments need (``SamplingParams.adjusts_logits``), empty
    otherwise: ``output_token_ids``, the tokens the request generated before it
    (re)started, for its penalties (the worker counts its samples from there);
    ``stop_token_ids``, every token that would stop it (the model's EOS
    included), which the worker holds back until ``min_tokens`` were generated;
    ``prompt_token_ids``, the whole prompt, for a repetition penalty (which
    counts the prompt: the worker never sees the prompt tokens it finds cached).
    """

    req_id: str
    sampling_params: SamplingParams
    num_prompt_tokens: int
    output_token_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()

    @classmethod
    def for_request(cls, request: Request) -> NewRequestData:
        """What a worker learns of ``request`` when it (re)starts."""
        params = request.sampling_params
        if not params.adjusts_logits:
            return cls(request.req_id, params, request.num_prompt_tokens)
        return cls(
            request.req_id, params, request.num_prompt_tokens,
            output_token_ids=tuple(request.output_token_ids) if params.has_penalties else (),
            stop_token_ids=tuple(sorted(request.stop_token_ids)) if params.min_tokens else (),
            prompt_token_ids=tuple(request.prompt_token_ids) if params.penalizes_prompt else (),
        )


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's slice of a plan, for readers that want it row by row."""

    req_id: str
    token_ids: list[int]
    start_position: int
    new_block_ids: list[int]
    sample: bool


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One forward pass of one replica.

    Workers first drop the state of ``finished_req_ids`` and
    ``preempted_req_ids``, then start ``new_requests`` with empty block tables,
    then, for every scheduled request in order, append its ``new_block_ids``
    to its table and compute its ``token_ids`` at positions
    ``num_computed_tokens[i]`` onward.  A request with ``sample[i]`` set has
    reached the end of its known tokens and gets one sampled token; rank 0
    returns these in plan order.

    NOTE: a request may hit prefix-cache blocks that an earlier request of
    the same plan is filling in this very step (blocks are cached when they
    are allocated).  Workers therefore write the K/V of the whole batch into
    the cache before any attention of that layer reads it.

    ``placeholder_rows`` (overlapped scheduling): rows whose single token is
    the one sampled for that request by the previous step, planned before it
    was known; ``token_ids`` holds 0 there and the worker puts in its own sample.

    ``prompt_logprobs_rows``: rows whose chunk yields prompt logprobs (increasing;
    see ``kvserve.scheduler.prompt_logprobs``); ``next_prompt_token_ids``: for
    each of them whose chunk ends before its prompt does, in order, the prompt
    token after the chunk.
    """

    step_id: int
    req_ids: list[str]
    num_scheduled_tokens: list[int]
    num_computed_tokens: list[int]
    token_ids: list[int]
    num_new_block_ids: list[int]
    new_block_ids: list[int]
    sample: list[bool]
    new_requests: list[NewRequestData]
    finished_req_ids: list[str]
    preempted_req_ids: list[str]
    placeholder_rows: list[int] = field(default_factory=list)
    prompt_logprobs_rows: list[int] = field(default_factory=list)
    next_prompt_token_ids: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_sampled(self) -> int:
        return sum(self.sample)

    @property
    def is_empty(self) -> bool:
        return not self.req_ids and not self.finished_req_ids and not self.preempted_req_ids

    def __iter__(self) -> Iterator[ScheduledRequest]:
        token_offset = 0
        block_offset = 0
        for i, req_id in enumerate(self.req_ids):
            num_tokens = self.num_scheduled_tokens[i]
            num_blocks = self.num_new_block_ids[i]
            yield ScheduledRequest(
                req_id=req_id,
                token_ids=self.token_ids[token_offset : token_offset + num_tokens],
                start_position=self.num_computed_tokens[i],
                new_block_ids=self.new_block_ids[block_offset : block_offset + num_blocks],
                sample=self.sample[i],
            )
            token_offset += num_tokens
            block_offset += num_blocks
