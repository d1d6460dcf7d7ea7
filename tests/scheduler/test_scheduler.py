"""The step scheduler: budgets, chunked prefill, preemption, stopping and aborts."""

from __future__ import annotations

import random

import pytest

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.request import FinishReason, Request, RequestStatus
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.step_plan import StepPlan
from tests.scheduler.paged_token_worker import (
    EOS_TOKEN_ID,
    PagedTokenWorker,
    reference_generate,
)


def make_scheduler(
    *,
    budget: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
    block_size: int = 4,
    num_blocks: int = 128,
    chunked: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
        ),
        CacheConfig(block_size=block_size, num_blocks=num_blocks),
    )


def run_to_completion(
    scheduler: Scheduler, worker: PagedTokenWorker | None = None, max_steps: int = 10_000
) -> dict[str, list[int]]:
    if worker is None:
        worker = PagedTokenWorker(scheduler.cache_config.num_blocks, scheduler.cache_config.block_size)
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        plan = scheduler.schedule()
        for out in scheduler.update(plan, worker.execute(plan)):
            outputs.setdefault(out.req_id, []).append(out.token_id)
    raise AssertionError("requests did not finish")


def random_prompts(n: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 50) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def add(scheduler: Scheduler, req_id: str, prompt: list[int], max_tokens: int = 8, **kw) -> Request:
    request = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, **kw), eos_token_ids=[EOS_TOKEN_ID])
    scheduler.add_request(request)
    return request


# -- budget and batching ------------------------------------------------------


def test_step_never_exceeds_the_token_budget_and_mixes_prefill_with_decode() -> None:
    scheduler = make_scheduler(budget=10)
    add(scheduler, "a", list(range(1, 7)), max_tokens=5, ignore_eos=True)
    worker = PagedTokenWorker(128, 4)
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == [6]
    scheduler.update(plan, worker.execute(plan))
    add(scheduler, "b", list(range(1, 21)), ignore_eos=True)
    plan = scheduler.schedule()
    # "a" decodes one token, "b" prefills a chunk of the remaining 9.
    assert plan.req_ids == ["a", "b"]
    assert plan.num_scheduled_tokens == [1, 9]
    assert plan.total_num_scheduled_tokens == 10
    assert plan.sample == [True, False]
    assert [n.req_id for n in plan.new_requests] == ["b"]


def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    scheduler = make_scheduler(budget=8)
    add(scheduler, "a", list(range(1, 21)), max_tokens=2, ignore_eos=True)
    worker = PagedTokenWorker(128, 4)
    chunks = []
    while True:
        plan = scheduler.schedule()
        chunks.append((plan.num_computed_tokens[0], plan.num_scheduled_tokens[0], plan.sample[0]))
        outs = scheduler.update(plan, worker.execute(plan))
        if outs:
            break
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]


def test_same_step_requests_share_blocks_cached_earlier_in_the_step() -> None:
    scheduler = make_scheduler(budget=64)
    add(scheduler, "a", list(range(1, 11)), max_tokens=2, ignore_eos=True)
    add(scheduler, "b", list(range(1, 11)), max_tokens=2, ignore_eos=True)
    worker = PagedTokenWorker(128, 4)
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == [10, 2]
    assert plan.new_block_ids == [1, 2, 3, 1, 2, 4]
    assert scheduler.update(plan, worker.execute(plan))[1].token_id == reference_generate(list(range(1, 11)), 1)[0]


def test_long_prefill_threshold_lets_several_prompts_progress_together() -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=256, long_prefill_token_threshold=8),
        CacheConfig(block_size=4, num_blocks=128),
    )
    for i, name in enumerate("abc"):
        add(scheduler, name, list(range(1 + 20 * i, 21 + 20 * i)), ignore_eos=True)
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == [8, 8, 8]
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == [8, 8, 8] and plan.num_computed_tokens == [8, 8, 8]


def test_chunked_prefill_off_waits_for_a_step_with_room() -> None:
    scheduler = make_scheduler(budget=16, max_model_len=16, chunked=False)
    add(scheduler, "a", list(range(1, 11)), max_tokens=2, ignore_eos=True)
    add(scheduler, "b", list(range(11, 21)), max_tokens=2, ignore_eos=True)
    plan = scheduler.schedule()
    assert plan.req_ids == ["a"]
    scheduler.update(plan, [5])
    plan = scheduler.schedule()
    assert plan.req_ids == ["a", "b"] and plan.num_scheduled_tokens == [1, 10]


def test_max_num_seqs_limits_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(4):
        add(scheduler, f"r{i}", [1, 2, 3])
    plan = scheduler.schedule()
    assert plan.req_ids == ["r0", "r1"]
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 2


def test_plan_sends_full_block_table_once_then_only_new_blocks() -> None:
    scheduler = make_scheduler(block_size=4)
    add(scheduler, "a", list(range(1, 8)), max_tokens=8, ignore_eos=True)
    worker = PagedTokenWorker(128, 4)
    plan = scheduler.schedule()
    assert plan.num_new_block_ids == [2] and plan.new_block_ids == [1, 2]
    scheduler.update(plan, worker.execute(plan))  # 8 tokens now: block 2 full
    plan = scheduler.schedule()
    assert plan.num_new_block_ids == [0] and plan.new_requests == []
    scheduler.update(plan, worker.execute(plan))  # 9th token needs block 3
    plan = scheduler.schedule()
    assert plan.num_new_block_ids == [1] and plan.new_block_ids == [3]


# -- correctness of whole runs ---------------------------------------------------


def test_outputs_match_the_reference_generator() -> None:
    scheduler = make_scheduler(budget=32)
    prompts = random_prompts(12, seed=1)
    for i, prompt in enumerate(prompts):
        add(scheduler, f"r{i}", prompt, max_tokens=10)
    outputs = run_to_completion(scheduler)
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == reference_generate(prompt, 10, frozenset({EOS_TOKEN_ID}))


def test_shared_prefixes_hit_the_cache_and_keep_results() -> None:
    scheduler = make_scheduler(budget=512)
    prompts = random_prompts(8, seed=2, shared_prefix=24)
    worker = PagedTokenWorker(128, 4)
    requests = [add(scheduler, "r0", prompts[0], max_tokens=6, ignore_eos=True)]
    run_to_completion(scheduler, worker)
    requests += [add(scheduler, f"r{i}", p, max_tokens=6, ignore_eos=True) for i, p in enumerate(prompts) if i]
    outputs = run_to_completion(scheduler, worker)
    assert all(r.num_cached_tokens == 24 for r in requests[1:])
    for i, prompt in enumerate(prompts[1:], start=1):
        assert outputs[f"r{i}"] == reference_generate(prompt, 6)


def test_preemption_and_resumption_give_identical_results() -> None:
    prompts = random_prompts(10, seed=3, shared_prefix=8)
    roomy = make_scheduler(budget=64, num_blocks=256)
    tight = make_scheduler(budget=64, num_blocks=24)
    requests = []
    for scheduler in (roomy, tight):
        for i, prompt in enumerate(prompts):
            requests.append(add(scheduler, f"r{i}", prompt, max_tokens=30, ignore_eos=True))
    expected = run_to_completion(roomy)
    got = run_to_completion(tight)
    assert got == expected
    assert sum(r.num_preemptions for r in requests[len(prompts):]) > 0
    assert tight.kv_cache_manager.get_num_free_blocks() == 23


def test_update_without_outputs_changes_state_exactly_as_with_them() -> None:
    # Tight pool: preemptions; an EOS-stopping request among length-limited ones.
    prompts = random_prompts(10, seed=5, shared_prefix=8)
    schedulers = [make_scheduler(budget=48, num_blocks=24) for _ in range(2)]
    workers = [PagedTokenWorker(24, 4) for _ in range(2)]
    requests: list[list[Request]] = [[], []]
    for side, scheduler in enumerate(schedulers):
        for i, prompt in enumerate(prompts):
            requests[side].append(add(scheduler, f"r{i}", prompt, max_tokens=30, ignore_eos=i % 3 != 0))
    num_steps = 0
    while schedulers[0].has_unfinished_requests():
        plans = [scheduler.schedule() for scheduler in schedulers]
        assert plans[0] == plans[1]
        tokens = workers[0].execute(plans[0])
        assert workers[1].execute(plans[1]) == tokens
        assert schedulers[1].update(plans[1], tokens, collect_outputs=False) == []
        assert schedulers[0].update(plans[0], tokens)  # the usual call still reports
        assert schedulers[0].get_load() == schedulers[1].get_load()
        num_steps += 1
    assert not schedulers[1].has_unfinished_requests()
    for with_outputs, without in zip(*requests):
        assert without.output_token_ids == with_outputs.output_token_ids
        assert without.finish_reason is with_outputs.finish_reason
        assert without.num_preemptions == with_outputs.num_preemptions
    assert sum(r.num_preemptions for r in requests[1]) > 0
    assert {r.finish_reason for r in requests[1]} == {FinishReason.STOP, FinishReason.LENGTH}


def test_preempted_request_goes_to_the_front_of_the_waiting_queue() -> None:
    scheduler = make_scheduler(budget=64, num_blocks=5, block_size=2, max_num_seqs=2)
    add(scheduler, "a", [1, 2, 3], max_tokens=6, ignore_eos=True)
    add(scheduler, "b", [4, 5, 6], max_tokens=6, ignore_eos=True)
    add(scheduler, "c", [7], max_tokens=2, ignore_eos=True)
    worker = PagedTokenWorker(5, 2)
    for _ in range(10):
        plan = scheduler.schedule()
        scheduler.update(plan, worker.execute(plan))
        if plan.preempted_req_ids:
            break
    assert plan.preempted_req_ids == ["b"]
    assert [r.req_id for r in scheduler.waiting] == ["b", "c"]
    assert scheduler.requests["b"].status is RequestStatus.PREEMPTED
    assert scheduler.kv_cache_manager.get_block_ids("b") == []


# -- stopping -------------------------------------------------------------------


def test_stops_at_max_tokens_with_length_reason() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", [1, 2, 3], max_tokens=3, ignore_eos=True)
    worker = PagedTokenWorker(128, 4)
    outs = []
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        outs += scheduler.update(plan, worker.execute(plan))
    assert [o.finish_reason for o in outs] == [None, None, FinishReason.LENGTH]


def _single_step_outputs(scheduler: Scheduler, token: int):
    plan = scheduler.schedule()
    return plan, scheduler.update(plan, [token] * plan.num_sampled)


def test_eos_stops_unless_ignored() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", [1, 2], max_tokens=5)
    add(scheduler, "b", [1, 2], max_tokens=5, ignore_eos=True)
    _, outs = _single_step_outputs(scheduler, EOS_TOKEN_ID)
    assert {o.req_id: o.finish_reason for o in outs} == {"a": FinishReason.STOP, "b": None}


def test_stop_token_ids_stop_the_request() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", [1, 2], max_tokens=5, stop_token_ids=(42,), ignore_eos=True)
    _, outs = _single_step_outputs(scheduler, 42)
    assert outs[0].finish_reason is FinishReason.STOP


def test_stop_tokens_do_not_stop_a_request_before_min_tokens() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", [1, 2], max_tokens=5, stop_token_ids=(42,), min_tokens=2)
    reasons = [_single_step_outputs(scheduler, 42)[1][0].finish_reason for _ in range(3)]
    assert reasons == [None, None, FinishReason.STOP]


def test_min_tokens_plans_reach_the_worker_with_the_stop_tokens_eos_included() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(Request("a", [1, 2], SamplingParams(stop_token_ids=(42,), min_tokens=1), eos_token_ids=(7,)))
    scheduler.add_request(Request("b", [1, 2], SamplingParams(min_tokens=1, ignore_eos=True), eos_token_ids=(7,)))
    plan = scheduler.schedule()
    assert [new.stop_token_ids for new in plan.new_requests] == [(7, 42), ()]


def test_stops_at_max_model_len() -> None:
    scheduler = make_scheduler(max_model_len=6)
    add(scheduler, "a", [1, 2, 3, 4], max_tokens=50, ignore_eos=True)
    _, first = _single_step_outputs(scheduler, 9)
    _, second = _single_step_outputs(scheduler, 9)
    assert first[0].finish_reason is None
    assert second[0].finish_reason is FinishReason.LENGTH


def test_finished_requests_free_their_blocks_and_are_announced_once() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", [1, 2, 3], max_tokens=1)
    plan, _ = _single_step_outputs(scheduler, 5)
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 127
    assert scheduler.schedule().finished_req_ids == ["a"]
    assert scheduler.schedule().finished_req_ids == []


def test_update_rejects_the_wrong_number_of_tokens() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", [1, 2, 3])
    plan = scheduler.schedule()
    with pytest.raises(ValueError, match="sampled 1 requests"):
        scheduler.update(plan, [])


# -- aborts -----------------------------------------------------------------------


def test_abort_while_waiting_removes_the_request() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    add(scheduler, "a", [1, 2, 3])
    add(scheduler, "b", [1, 2, 3])
    scheduler.schedule()
    (aborted,) = scheduler.abort_requests(["b"])
    assert aborted.finish_reason is FinishReason.ABORT
    assert list(scheduler.waiting) == [] and "b" not in scheduler.requests
    assert scheduler.schedule().finished_req_ids == []  # workers never saw "b"


def test_abort_while_running_frees_blocks_and_tells_the_workers() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", list(range(1, 10)))
    plan = scheduler.schedule()
    scheduler.update(plan, [3])
    scheduler.abort_requests(["a", "unknown"])
    assert scheduler.kv_cache_manager.get_num_free_blocks() == 127
    assert scheduler.running == []
    assert scheduler.schedule().finished_req_ids == ["a"]


def test_abort_during_an_inflight_step_drops_its_token() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", [1, 2, 3])
    add(scheduler, "b", [1, 2, 3])
    plan = scheduler.schedule()
    scheduler.abort_requests(["a"])
    outs = scheduler.update(plan, [7, 8])
    assert [(o.req_id, o.token_id) for o in outs] == [("b", 8)]


def retried_during_its_step(scheduler: Scheduler) -> tuple[StepPlan, Request]:
    """Request "a" planned, then aborted while its step runs and added again under its id: the step's
    plan, and the new request."""
    add(scheduler, "a", [1, 2, 3])
    plan = scheduler.schedule()
    scheduler.abort_requests(["a"])
    return plan, add(scheduler, "a", [4, 5, 6])


def test_a_request_reusing_the_id_of_one_aborted_during_an_inflight_step_gets_none_of_its_results() -> None:
    # A client that cancels and retries under the same request id: the old request's token, when its
    # step came back, was applied to the new one, which then counted -1 tokens on their way and was
    # never scheduled, and held every request queued behind it.
    scheduler = make_scheduler()
    plan, retry = retried_during_its_step(scheduler)
    add(scheduler, "b", [1, 2, 3])

    assert scheduler.update(plan, [7]) == []

    assert (retry.num_pending_tokens, retry.output_token_ids) == (0, [])
    next_plan = scheduler.schedule()
    assert next_plan.req_ids == ["a", "b"] and next_plan.finished_req_ids == ["a"]
    assert [new.req_id for new in next_plan.new_requests] == ["a", "b"]
    assert [(o.req_id, o.token_id) for o in scheduler.update(next_plan, [8, 9])] == [("a", 8), ("b", 9)]
    assert retry.output_token_ids == [8]


def test_a_failed_step_leaves_a_request_that_reuses_the_id_of_one_it_held() -> None:
    scheduler = make_scheduler()
    plan, retry = retried_during_its_step(scheduler)

    scheduler.discard_step(plan)

    assert scheduler.requests == {"a": retry} and retry.status is RequestStatus.WAITING


def test_a_plan_is_applied_once() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", [1, 2, 3])
    plan = scheduler.schedule()
    scheduler.update(plan, [7])
    with pytest.raises(ValueError, match="step 0 is not a step planned here and not applied yet"):
        scheduler.update(plan, [7])


# -- admission --------------------------------------------------------------------


def test_duplicate_request_id_is_rejected() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", [1])
    with pytest.raises(ValueError, match="already in use"):
        add(scheduler, "a", [1])


@pytest.mark.parametrize("salt", [0, 1, b"tenant", False])
def test_a_cache_salt_that_is_not_a_string_is_rejected(salt: object) -> None:
    # 0 and False would have hashed as no salt at all (another tenant's cache), 1 failed deep in hashing.
    with pytest.raises(ValueError, match="cache_salt must be a string or None"):
        Request("a", [1, 2, 3], cache_salt=salt)  # type: ignore[arg-type]


def test_prompt_longer_than_max_model_len_is_rejected() -> None:
    scheduler = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        add(scheduler, "a", list(range(9)))


@pytest.mark.parametrize("position", [1, 9], ids=["in-a-full-block", "in-the-partial-last-block"])
@pytest.mark.parametrize("bad_id", [-1, 2**32])
def test_a_token_id_that_cannot_be_hashed_is_refused_before_it_wedges_the_scheduler(position, bad_id) -> None:  # noqa: ANN001
    # Hashed in schedule(), it raised after running requests had advanced for a
    # step that never ran (their counters off by it), then at every later step.
    scheduler = make_scheduler(block_size=4)
    running = add(scheduler, "a", [5] * 8, max_tokens=4)
    scheduler.update(scheduler.schedule(), [6])
    prompt = [5] * 10
    prompt[position] = bad_id

    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*32\)"):
        add(scheduler, "b", prompt)

    plan = scheduler.schedule()  # the scheduler goes on without "b"
    assert plan.req_ids == ["a"] and running.num_computed_tokens == 9
    assert scheduler.get_load().num_running_tokens == 9 and "b" not in scheduler.requests


def test_request_that_could_never_fit_in_the_pool_is_rejected() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(
        ValueError, match=r"needs up to 4 KV blocks with max_tokens=8 but the pool has only 3 usable \(of 4: one is the null"
    ):
        add(scheduler, "a", list(range(1, 10)), max_tokens=8)
    # The prompt alone is too big: max_tokens is not what to lower.
    with pytest.raises(ValueError, match=r"a prompt of 13 tokens alone needs 4 KV blocks but the pool has only 3 usable"):
        add(scheduler, "c", list(range(1, 14)), max_tokens=1)
    add(scheduler, "b", list(range(1, 10)), max_tokens=4)  # 12 KV tokens = 3 blocks: fits


def test_stats_report_queues_usage_and_hit_rate() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    add(scheduler, "a", list(range(1, 9)))
    add(scheduler, "b", list(range(1, 13)))
    scheduler.schedule()
    stats = scheduler.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_queued_prefill_tokens) == (1, 1, 12)
    assert stats.kv_cache_usage == pytest.approx(2 / 127)
