"""Prompt logprobs: how likely the model found each prompt token, given the tokens before it.

A request asks with ``SamplingParams.prompt_logprobs`` (``k`` alternatives per
position).  The logprob of prompt token ``t`` comes from the logits at position
``t - 1``, so a prefill chunk over positions ``[s, e)`` yields those of tokens
``s + 1 .. min(e, P - 1)`` (``P`` prompt tokens; the last position predicts the
first output token instead)::

    prompt       t0  t1  t2  t3  t4  t5            P = 6
    chunk 1      [s=0         e=3)                 -> logprobs of t1 t2 t3  (t3: the next chunk's
    chunk 2                  [s=3      e=6)        -> logprobs of t4 t5       first token, sent along)

The plan names such rows (``StepPlan.prompt_logprobs_rows``) and, for each whose
chunk ends before the prompt does, the token after it
(``StepPlan.next_prompt_token_ids``); the worker computes the logprobs from the
same logits as the forward pass, and the step's result brings them back
(``StepPromptLogprobs``).  The request keeps them in order
(``Request.prompt_logprobs``), and its first output carries them all.

Tokens served from the prefix cache have no logits: a request whose prompt
logprobs are incomplete reads at most as many cached tokens as it already has
logprobs for (none at first; after a preemption, what it had).  A chunk that
computes positions again (after a preemption) yields logprobs it already has,
which are dropped.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvserve.scheduler.logprobs import StepPromptLogprobs, TokenLogprobs
from kvserve.scheduler.request import Request
from kvserve.scheduler.step_plan import StepPlan


def wants_prompt_logprobs(request: Request, start: int) -> bool:
    """Whether a chunk of ``request`` starting at position ``start`` should return prompt logprobs."""
    logprobs = request.prompt_logprobs
    return logprobs is not None and start < request.num_prompt_tokens - 1 and len(logprobs) < request.num_prompt_tokens - 1


def plan_prompt_logprobs(
    request: Request, row: int, start: int, prompt_logprobs_rows: list[int], next_prompt_token_ids: list[int]
) -> None:
    """Name ``row``, a chunk of ``request`` from position ``start`` to its ``num_computed_tokens``, among the
    plan's prompt-logprobs rows, with the token after it when the prompt goes on, if it needs them."""
    if not wants_prompt_logprobs(request, start):
        return
    prompt_logprobs_rows.append(row)
    end = request.num_computed_tokens
    if end < request.num_prompt_tokens:
        next_prompt_token_ids.append(request.all_token_ids[end])


def max_cached_tokens(request: Request) -> int | None:
    """The most prompt tokens ``request`` may take from the prefix cache (``None``: no bound of its own)."""
    logprobs = request.prompt_logprobs
    if logprobs is None or len(logprobs) >= request.num_prompt_tokens - 1:
        return None
    return len(logprobs)


def record_prompt_logprobs(plan: StepPlan, step: StepPromptLogprobs, requests: Mapping[str, Request]) -> None:
    """Append to each request the prompt logprobs ``step`` brings that it does not have yet."""
    for row, logprobs in step.per_row():
        if not 0 <= row < plan.num_reqs:
            raise ValueError(f"step {plan.step_id}: prompt logprobs for row {row} of {plan.num_reqs}")
        request = requests.get(plan.req_ids[row])
        if request is None or request.prompt_logprobs is None:
            continue  # aborted while the step ran
        kept = request.prompt_logprobs
        first_target = plan.num_computed_tokens[row] + 1
        # Entry i of ``logprobs`` is the prompt token at position first_target + i; kept has tokens 1 .. len(kept).
        skip = len(kept) + 1 - first_target
        if 0 <= skip < len(logprobs):
            kept.extend(logprobs[skip:])


def first_output_prompt_logprobs(request: Request) -> list[TokenLogprobs | None] | None:
    """What ``request``'s first output carries: ``None`` for the first prompt token (nothing comes before
    it), then each prompt token's logprobs; ``None`` when the request did not ask."""
    if request.prompt_logprobs is None:
        return None
    return [None, *request.prompt_logprobs]
