"""Overlapped scheduling: the next step is planned before the last one's tokens are applied.

A request sampled by step N is planned into N+1 with a placeholder row; its tokens
are applied in order when they come, also after a preemption; a token that must end
the request (its last allowed one) is not planned past.  Driven with a fake model
whose token depends only on (request, output index), an overlapped run must give
every request the outputs of a plain run.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
import xxhash

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.request import Request, RequestStatus
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.step_plan import StepPlan

STOP_TOKEN = 3


def fake_tokens(plan: StepPlan, num_prompt_tokens: dict[str, int]) -> list[int]:
    """The fake model's sample for each sampled row: a function of (request, output index) alone."""
    tokens = []
    for req_id, start, num, sample in zip(plan.req_ids, plan.num_computed_tokens, plan.num_scheduled_tokens, plan.sample):
        if sample:
            index = start + num - num_prompt_tokens[req_id]
            tokens.append(xxhash.xxh64_intdigest(f"{req_id}/{index}".encode()) % 8)
    return tokens


def make_scheduler(num_blocks: int = 64, budget: int = 16) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=96),
        CacheConfig(block_size=4, num_blocks=num_blocks),
    )


def check_counters(scheduler: Scheduler) -> None:
    load, stats = scheduler.get_load(), scheduler.get_stats()
    assert load.num_queued_prefill_tokens == stats.num_queued_prefill_tokens
    assert load.num_running == stats.num_running and load.num_waiting == stats.num_waiting


def run(scheduler: Scheduler, requests: list[Request], steps_ahead: int) -> tuple[dict[str, list[int]], int]:
    """Every request's outputs, and how many placeholder rows the run planned.

    ``steps_ahead`` steps stay launched and unapplied after each schedule (0: a plain run), as
    ``EngineCore`` keeps them; a worker fills a placeholder from its last sampling step, so
    every placeholder's request must have been sampled by it.
    """
    prompts = {r.req_id: r.num_prompt_tokens for r in requests}
    for request in requests:
        scheduler.add_request(request)
    outputs: dict[str, list[int]] = {r.req_id: [] for r in requests}
    in_flight: deque[tuple[StepPlan, list[int]]] = deque()
    last_sampled: set[str] = set()  # the requests sampled by the worker's last sampling step
    num_placeholders = 0
    for _ in range(2000):
        if not scheduler.has_unfinished_requests() and not in_flight:
            break
        plan = scheduler.schedule()
        num_placeholders += len(plan.placeholder_rows)
        for row in plan.placeholder_rows:
            assert plan.num_scheduled_tokens[row] == 1 and plan.sample[row]
            assert plan.req_ids[row] in last_sampled
        if steps_ahead == 0:
            assert not plan.placeholder_rows  # nothing is on its way when the plan is made
        if not plan.is_empty:
            in_flight.append((plan, fake_tokens(plan, prompts)))
            if any(plan.sample):
                last_sampled = {req_id for req_id, sample in zip(plan.req_ids, plan.sample) if sample}
            if len(in_flight) <= steps_ahead:
                continue
        if not in_flight:
            continue
        for output in scheduler.update(*in_flight.popleft()):
            outputs[output.req_id].append(output.token_id)
        check_counters(scheduler)
    else:
        raise AssertionError("the run did not finish")
    return outputs, num_placeholders


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("num_blocks", [12, 64])
@pytest.mark.parametrize("steps_ahead", [1, 2, 3])
def test_overlapped_runs_give_every_request_the_plain_outputs(seed: int, num_blocks: int, steps_ahead: int) -> None:
    def requests() -> list[Request]:
        rng = random.Random(seed)
        shared = [rng.randrange(8) for _ in range(8)]
        return [
            Request(f"r{i}", (shared if rng.random() < 0.5 else []) + [rng.randrange(8) for _ in range(rng.randrange(1, 20))],
                    SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True,
                                   stop_token_ids=[STOP_TOKEN] if rng.random() < 0.5 else []))
            for i in range(10)
        ]

    plain, _ = run(make_scheduler(num_blocks), requests(), steps_ahead=0)
    overlapped, num_placeholders = run(make_scheduler(num_blocks), requests(), steps_ahead=steps_ahead)
    assert overlapped == plain
    assert num_placeholders > 0


def test_a_decode_is_planned_again_with_a_placeholder_before_its_token_is_applied() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)))
    first = scheduler.schedule()
    second = scheduler.schedule()  # planned before update(first)
    assert second.req_ids == ["a"] and second.placeholder_rows == [0]
    assert second.num_computed_tokens == [3] and second.token_ids == [0]
    assert [o.token_id for o in scheduler.update(first, [7])] == [7]
    assert [o.token_id for o in scheduler.update(second, [6])] == [6]
    assert scheduler.requests["a"].output_token_ids == [7, 6]


def test_a_request_whose_pending_token_is_its_last_is_not_planned_past_it() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(Request("a", [1, 2], SamplingParams(max_tokens=1)))
    first = scheduler.schedule()
    assert scheduler.schedule().req_ids == []
    [output] = scheduler.update(first, [5])
    assert output.finish_reason is not None and not scheduler.has_unfinished_requests()


def test_a_stop_seen_late_drops_the_next_token_and_frees_the_blocks() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(Request("a", [1, 2], SamplingParams(max_tokens=9, stop_token_ids=[STOP_TOKEN])))
    first = scheduler.schedule()
    second = scheduler.schedule()
    [output] = scheduler.update(first, [STOP_TOKEN])
    assert output.finish_reason is not None
    assert scheduler.update(second, [4]) == []
    assert scheduler.kv_cache_manager.get_block_ids("a") == []
    assert scheduler.schedule().finished_req_ids == ["a"]


def test_a_token_on_its_way_when_its_request_is_preempted_is_kept() -> None:
    # Two requests fill the pool's 3 usable blocks of 4; b's next token needs a fourth block.
    scheduler = make_scheduler(num_blocks=4, budget=16)
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)))
    scheduler.add_request(Request("b", [4, 5, 6, 7, 4, 5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
    first = scheduler.schedule()
    assert first.req_ids == ["a", "b"]
    second = scheduler.schedule()  # b's pending token needs a new block: b is preempted
    assert second.preempted_req_ids == ["b"] and scheduler.requests["b"].status is RequestStatus.PREEMPTED
    outputs = scheduler.update(first, [8, 9])
    assert [(o.req_id, o.token_id) for o in outputs] == [("a", 8), ("b", 9)]
    assert scheduler.requests["b"].all_token_ids == [4, 5, 6, 7, 4, 5, 6, 7, 9]  # recomputed with its token
    check_counters(scheduler)



def test_with_two_steps_in_flight_a_request_preempted_with_a_token_on_its_way_resumes_after_it() -> None:
    # As above; b's token from the first step is on its way while the second and third are planned.
    scheduler = make_scheduler(num_blocks=4, budget=16)
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
    scheduler.add_request(Request("b", [4, 5, 6, 7, 4, 5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert second.preempted_req_ids == ["b"] and second.placeholder_rows == [0]
    third = scheduler.schedule()  # b waits first in line, its token unknown: it is not planned
    assert third.req_ids == ["a"] and scheduler.requests["b"].status is RequestStatus.PREEMPTED
    scheduler.update(first, [8, 9])
    scheduler.update(second, [10])
    [done] = scheduler.update(third, [11])  # a's last token: its blocks go back
    assert done.req_id == "a" and done.finish_reason is not None
    fourth = scheduler.schedule()  # b resumes with the token it had on its way
    assert "b" in fourth.req_ids
    assert scheduler.requests["b"].all_token_ids == [4, 5, 6, 7, 4, 5, 6, 7, 9]
    check_counters(scheduler)
