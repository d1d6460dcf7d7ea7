"""Which chunks return prompt logprobs, what the request keeps of them, and what it may read from the cache."""

from __future__ import annotations

from kvserve.scheduler.prompt_logprobs import record_prompt_logprobs
from kvserve.scheduler.logprobs import StepPromptLogprobs, TokenLogprobs
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.step_plan import StepPlan
from tests.scheduler.test_scheduler import make_scheduler

PROMPT = list(range(20, 30))  # 10 tokens: logprobs for the 9 after the first


def step_logprobs(plan: StepPlan) -> StepPromptLogprobs:
    """Prompt logprobs for each of ``plan``'s rows: the value of the token at position p is ``-p``."""
    rows, num_positions, values = [], [], []
    for row in plan.prompt_logprobs_rows:
        start = plan.num_computed_tokens[row]
        last = min(start + plan.num_scheduled_tokens[row], len(PROMPT) - 1)
        rows.append(row)
        num_positions.append(last - start)
        values.extend(-float(p) for p in range(start + 1, last + 1))
    return StepPromptLogprobs(rows, num_positions, [0] * len(rows), values, [], [])


def add(scheduler, req_id: str, prompt_logprobs: int | None = 0) -> Request:
    request = Request(req_id, PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=prompt_logprobs))
    scheduler.add_request(request)
    return request


def test_each_chunk_of_the_prompt_returns_logprobs_with_the_token_after_it() -> None:
    scheduler = make_scheduler(budget=4, block_size=4)
    request = add(scheduler, "a")
    plans = []
    while request.num_computed_tokens < len(PROMPT):
        plan = scheduler.schedule()
        plans.append(plan)
        scheduler.update(plan, [7] * plan.num_sampled, prompt_logprobs=step_logprobs(plan))
    # Chunks [0, 4), [4, 8), [8, 10): the first two need the token after them, the last predicts the output.
    assert [(p.prompt_logprobs_rows, p.next_prompt_token_ids) for p in plans] == [
        ([0], [PROMPT[4]]), ([0], [PROMPT[8]]), ([0], []),
    ]
    assert [entry.logprob for entry in request.prompt_logprobs] == [-float(p) for p in range(1, 10)]
    decode = scheduler.schedule()
    assert decode.prompt_logprobs_rows == []  # nothing more once the prompt is done


def test_a_recomputed_chunk_adds_only_the_logprobs_the_request_lacks() -> None:
    scheduler = make_scheduler(budget=4, block_size=4)
    request = add(scheduler, "a")
    first = scheduler.schedule()
    scheduler.update(first, [], prompt_logprobs=step_logprobs(first))
    assert len(request.prompt_logprobs) == 4
    # The same positions again, as after a preemption: nothing is added twice.
    record_prompt_logprobs(first, step_logprobs(first), {"a": request})
    assert [entry.logprob for entry in request.prompt_logprobs] == [-1.0, -2.0, -3.0, -4.0]


def test_requests_not_asking_and_one_token_prompts_get_no_rows() -> None:
    scheduler = make_scheduler()
    add(scheduler, "plain", prompt_logprobs=None)
    scheduler.add_request(Request("short", [5], SamplingParams(max_tokens=2, prompt_logprobs=1)))
    plan = scheduler.schedule()
    assert plan.prompt_logprobs_rows == [] and plan.next_prompt_token_ids == []


def test_the_cache_serves_only_the_tokens_whose_logprobs_the_request_has() -> None:
    scheduler = make_scheduler(block_size=4)
    kv = scheduler.kv_cache_manager
    filler = Request("filler", PROMPT, SamplingParams(max_tokens=1))
    scheduler.add_request(filler)
    plan = scheduler.schedule()
    scheduler.update(plan, [7])  # the prompt's two full blocks are cached now
    asking = Request("asking", PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert kv.get_computed_blocks(asking).num_tokens == 0
    asking.prompt_logprobs.extend([TokenLogprobs(-1.0)] * 5)  # as if preempted after 5
    assert kv.get_computed_blocks(asking).num_tokens == 4
    asking.prompt_logprobs.extend([TokenLogprobs(-1.0)] * 4)  # all 9: the cache as for any request
    assert kv.get_computed_blocks(asking).num_tokens == 8
