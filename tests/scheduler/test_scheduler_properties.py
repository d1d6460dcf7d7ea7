"""Scheduler invariants under random arrivals, steps and aborts, with preemption forced.

A hypothesis state machine drives one Scheduler with a tiny pool (block_size
4, a handful of blocks) and a small token budget, so that chunked prefill,
prefix hits and preemption all happen.  It also plays the workers: it keeps
the block tables a worker rebuilds from the plans alone, a fake paged KV
cache (each slot holds the token prefix it was computed for), and a
deterministic fake sampler keyed by (req_id, output position as the worker
sees it).  Preemption, chunking and prefix hits must never change what a
request generates: every request's output equals the fake sampler's sequence.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import xxhash
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.request import FinishReason, Request, RequestStatus
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.step_plan import StepPlan
from tests.scheduler.test_block_pool_properties import (
    CacheIndexObserver,
    assert_pool_invariants,
    cached_pairs,
)

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
STOP_TOKEN = 3
NUM_FAKE_TOKENS = 4  # sampled tokens are 0..3
# A shared "system prompt" (or none) and a short tail from a two-token alphabet,
# so that prompts share whole blocks and admissions hit the prefix cache.
SYSTEM_PROMPTS = ([], [0, 1, 1, 0], [1, 0, 0, 1, 1, 1, 0, 0])
PROMPTS = st.builds(
    lambda system, tail: [*system, *tail],
    st.sampled_from(SYSTEM_PROMPTS),
    st.lists(st.integers(0, 1), max_size=10),
).filter(bool)


def fake_token(req_id: str, output_index: int) -> int:
    """The token a deterministic fake model samples as ``req_id``'s ``output_index``-th output."""
    return xxhash.xxh64_intdigest(f"{req_id}/{output_index}".encode()) % NUM_FAKE_TOKENS


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def test_aborting_a_request_that_waited_for_blocks_leaves_no_block_table() -> None:
    """A waiting request whose admission failed for lack of blocks, then aborted, leaves nothing behind."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=MAX_MODEL_LEN),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=3),
    )
    scheduler.add_request(Request("a", [0] * 8, SamplingParams(max_tokens=1)))  # both usable blocks
    scheduler.add_request(Request("b", [1] * 4, SamplingParams(max_tokens=1)))  # one more block
    plan = scheduler.schedule()
    assert plan.req_ids == ["a"]  # "b" found no free block and waits

    scheduler.abort_requests(["b"])

    assert "b" not in scheduler.kv_cache_manager.req_to_blocks
    assert "b" not in scheduler.kv_cache_manager.num_cached_blocks


def test_a_request_that_max_model_len_stops_early_is_admitted_when_it_fits() -> None:
    """Admission counts the KV a request can really need, max_model_len included.

    With max_model_len 5 a request stops once it has 5 tokens, so at most 4 of
    them (the last sampled one is never fed back) need KV: one block of 4.
    A pool with one usable block can serve it.
    """
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=1, max_model_len=5),
        CacheConfig(block_size=4, num_blocks=2),
    )

    scheduler.add_request(Request("r0", [0], SamplingParams(max_tokens=10)))

    assert scheduler.has_unfinished_requests()


class SchedulerMachine(RuleBasedStateMachine):
    """Drives one Scheduler and simulates its workers and model."""

    @initialize(
        # Mostly tiny budgets, so that prompts are chunked.
        max_num_batched_tokens=st.integers(4, 8) | st.integers(4, 32),
        max_num_seqs=st.integers(1, 4),
        long_prefill_token_threshold=st.none() | st.integers(1, 8),
        # Few blocks, so that running requests run out of them and are preempted.
        num_blocks=st.integers(3, 9),
    )
    def create_scheduler(
        self,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        long_prefill_token_threshold: int | None,
        num_blocks: int,
    ) -> None:
        self.scheduler_config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=MAX_MODEL_LEN,
            long_prefill_token_threshold=long_prefill_token_threshold,
        )
        self.cache_config = CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks)
        self.observer = CacheIndexObserver()
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config, self.observer)
        self.kv = self.scheduler.kv_cache_manager
        # Every request the scheduler accepted, finished or not.
        self.requests: dict[str, Request] = {}
        self.num_created = 0
        # The workers' view: block tables rebuilt from plans, prompt lengths, and
        # the paged KV cache (block id -> slot -> the token prefix it encodes).
        self.worker_tables: dict[str, list[int]] = {}
        self.worker_num_prompt_tokens: dict[str, int] = {}
        # The request each worker table is of (an id may name a newer request once its old one is aborted).
        self.worker_requests: dict[str, Request] = {}
        self.kv_slots: dict[int, dict[int, tuple[int, ...]]] = {}

    # -- rules -------------------------------------------------------------------

    @rule(
        new_requests=st.lists(
            st.tuples(PROMPTS, st.integers(1, 8), st.booleans()), min_size=1, max_size=3
        )
    )
    def add_requests(self, new_requests: list[tuple[list[int], int, bool]]) -> None:
        for prompt, max_tokens, stops in new_requests:
            self.add_request(prompt, max_tokens, stops)

    def add_request(self, prompt: list[int], max_tokens: int, stops: bool, req_id: str | None = None) -> None:
        if req_id is None:
            req_id = f"r{self.num_created}"
            self.num_created += 1
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=(STOP_TOKEN,) if stops else ())
        request = Request(req_id, prompt, params)
        # The KV it can ever need: every token but the last sampled one.
        max_kv_tokens = max(len(prompt), min(len(prompt) + max_tokens - 1, MAX_MODEL_LEN - 1))
        fits = (
            len(prompt) <= MAX_MODEL_LEN
            and ceil_div(max_kv_tokens, BLOCK_SIZE) <= self.cache_config.num_usable_blocks
        )
        if not fits:
            with pytest.raises(ValueError):
                self.scheduler.add_request(request)
            assert req_id not in self.scheduler.requests
            return
        self.scheduler.add_request(request)
        self.requests[req_id] = request

    @rule()
    def step(self) -> None:
        self.run_one_step()

    @precondition(lambda self: self.scheduler.has_unfinished_requests())
    @rule()
    def run_until_idle(self) -> None:
        # Liveness: every step advances the oldest running request (it can
        # preempt all the others, and alone it fits), and a request that
        # becomes the oldest recomputes at most its own tokens; so each
        # request is the oldest for at most 2 * (prompt + max_tokens) steps.
        max_steps = sum(
            2 * (request.num_prompt_tokens + request.sampling_params.max_tokens)
            for request in self.scheduler.requests.values()
        )
        for _ in range(max_steps):
            self.run_one_step()
            if not self.scheduler.has_unfinished_requests():
                return
        raise AssertionError(f"not finished after {max_steps} steps: {sorted(self.scheduler.requests)}")

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort_request(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.requests)), label="req_id")
        request = self.requests[req_id]
        was_finished = request.is_finished

        aborted = self.scheduler.abort_requests([req_id])

        if was_finished:  # finished or aborted before: ignored
            assert aborted == []
            return
        assert aborted == [request]
        assert request.status is RequestStatus.FINISHED_ABORTED
        assert request.finish_reason is FinishReason.ABORT
        assert self.kv.get_block_ids(req_id) == []

    @precondition(lambda self: self.scheduler.has_unfinished_requests())
    @rule(data=st.data())
    def step_with_an_abort_in_flight(self, data: st.DataObject) -> None:
        """A request aborted between ``schedule`` and ``update`` gets no token."""

        def abort_one(plan: StepPlan) -> set[str]:
            if not plan.req_ids:
                return set()
            req_id = data.draw(st.sampled_from(plan.req_ids), label="aborted_in_flight")
            assert self.scheduler.abort_requests([req_id]) == [self.requests[req_id]]
            return {req_id}

        self.run_one_step(abort_one)

    @precondition(lambda self: self.scheduler.has_unfinished_requests())
    @rule(data=st.data(), retry=st.tuples(PROMPTS, st.integers(1, 8), st.booleans()))
    def step_with_an_abort_and_a_retry_under_its_id_in_flight(
        self, data: st.DataObject, retry: tuple[list[int], int, bool]
    ) -> None:
        """A client that cancels and retries under the same request id while the step runs: the retry
        gets none of the step's results (they went to it by id, and it was never scheduled)."""

        def abort_and_retry(plan: StepPlan) -> set[str]:
            if not plan.req_ids:
                return set()
            req_id = data.draw(st.sampled_from(plan.req_ids), label="retried_in_flight")
            assert self.scheduler.abort_requests([req_id]) == [self.requests[req_id]]
            self.add_request(*retry, req_id=req_id)
            return {req_id}

        self.run_one_step(abort_and_retry)

    # -- one step, as the engine and its workers run it -----------------------------

    def run_one_step(self, while_in_flight: Callable[[StepPlan], set[str]] | None = None) -> None:
        before = {
            req_id: (request.status, request.num_computed_tokens)
            for req_id, request in self.scheduler.requests.items()
        }
        waiting_before = [request.req_id for request in self.scheduler.waiting]
        plan = self.scheduler.schedule()
        self.check_plan(plan, before, waiting_before)
        sampled_req_ids, sampled_token_ids = self.run_plan_on_workers(plan)
        aborted = while_in_flight(plan) if while_in_flight is not None else set()

        outputs = self.scheduler.update(plan, sampled_token_ids)

        assert [(out.req_id, out.token_id) for out in outputs] == [
            (req_id, token_id)
            for req_id, token_id in zip(sampled_req_ids, sampled_token_ids)
            if req_id not in aborted
        ]
        for out in outputs:
            request = self.requests[out.req_id]
            assert request.output_token_ids[-1] == out.token_id
            if out.token_id in request.stop_token_ids:
                expected_reason = FinishReason.STOP
            elif (
                request.num_output_tokens >= request.sampling_params.max_tokens
                or request.num_tokens >= MAX_MODEL_LEN
            ):
                expected_reason = FinishReason.LENGTH
            else:
                expected_reason = None
            assert out.finish_reason is expected_reason
            assert request.is_finished == (expected_reason is not None)

    def check_plan(
        self, plan: StepPlan, before: dict[str, tuple[RequestStatus, int]], waiting_before: list[str]
    ) -> None:
        num_reqs = plan.num_reqs
        assert len(plan.num_scheduled_tokens) == len(plan.num_computed_tokens) == num_reqs
        assert len(plan.num_new_block_ids) == len(plan.sample) == num_reqs
        assert len(plan.token_ids) == sum(plan.num_scheduled_tokens)
        assert len(plan.new_block_ids) == sum(plan.num_new_block_ids)
        assert plan.total_num_scheduled_tokens <= self.scheduler_config.max_num_batched_tokens
        max_chunk = self.scheduler_config.long_prefill_token_threshold
        if max_chunk is not None:
            assert max(plan.num_scheduled_tokens, default=0) <= max_chunk
        assert len(set(plan.req_ids)) == num_reqs, f"a request is scheduled twice: {plan.req_ids}"
        new_req_ids = [new.req_id for new in plan.new_requests]
        assert len(set(new_req_ids)) == len(new_req_ids)
        assert set(new_req_ids) <= set(plan.req_ids)
        # Waiting requests are admitted first come, first served.
        assert new_req_ids == waiting_before[: len(new_req_ids)]
        assert len(self.scheduler.running) <= self.scheduler_config.max_num_seqs

        for row in plan:
            request = self.requests[row.req_id]
            status_before, num_computed_before = before[row.req_id]
            num_scheduled = len(row.token_ids)
            end = row.start_position + num_scheduled
            assert num_scheduled >= 1
            assert end <= request.num_tokens
            assert row.sample == (end == request.num_tokens)
            assert row.token_ids == request.all_token_ids[row.start_position : end]
            assert request.status is RequestStatus.RUNNING
            assert request.num_computed_tokens == end
            if status_before is RequestStatus.RUNNING:
                assert row.req_id not in new_req_ids
                assert row.start_position == num_computed_before
            else:
                # Admitted from the waiting queue: starts after its prefix-cache hit.
                assert row.req_id in new_req_ids
                assert row.start_position % BLOCK_SIZE == 0
                assert row.start_position < request.num_tokens

        for req_id in plan.preempted_req_ids:
            request = self.requests[req_id]
            assert before[req_id][0] is RequestStatus.RUNNING
            assert req_id not in plan.req_ids
            assert request.status is RequestStatus.PREEMPTED
            assert request.num_computed_tokens == 0
        if plan.preempted_req_ids:
            assert plan.new_requests == [], "a step that preempted must not admit waiting requests"
            # Preempted requests go back to the front of the queue, the last preempted first.
            waiting_ids = [request.req_id for request in self.scheduler.waiting]
            assert waiting_ids == [*reversed(plan.preempted_req_ids), *waiting_before]

        # Workers drop exactly the requests they know that have finished since.
        finished_known = {req_id for req_id, request in self.worker_requests.items() if request.is_finished}
        assert sorted(plan.finished_req_ids) == sorted(finished_known)

    def run_plan_on_workers(self, plan: StepPlan) -> tuple[list[str], list[int]]:
        """Apply ``plan`` as a worker would; return the sampled rows and the fake model's tokens."""
        for req_id in [*plan.finished_req_ids, *plan.preempted_req_ids]:
            del self.worker_tables[req_id]
            del self.worker_requests[req_id]
        for new in plan.new_requests:
            assert new.req_id not in self.worker_tables
            self.worker_tables[new.req_id] = []
            self.worker_requests[new.req_id] = self.requests[new.req_id]
            self.worker_num_prompt_tokens[new.req_id] = new.num_prompt_tokens
        rows = list(plan)
        # Each layer writes the KV of every scheduled token before attention reads any.
        for row in rows:
            table = self.worker_tables[row.req_id]
            table.extend(row.new_block_ids)
            all_token_ids = self.requests[row.req_id].all_token_ids
            for offset in range(len(row.token_ids)):
                position = row.start_position + offset
                slots = self.kv_slots.setdefault(table[position // BLOCK_SIZE], {})
                slots[position % BLOCK_SIZE] = tuple(all_token_ids[: position + 1])
        sampled_req_ids: list[str] = []
        sampled_token_ids: list[int] = []
        for row in rows:
            table = self.worker_tables[row.req_id]
            all_token_ids = self.requests[row.req_id].all_token_ids
            end = row.start_position + len(row.token_ids)
            for position in range(end):
                block_id = table[position // BLOCK_SIZE]
                slot = self.kv_slots.get(block_id, {}).get(position % BLOCK_SIZE)
                assert slot == tuple(all_token_ids[: position + 1]), (
                    f"{row.req_id} reads wrong KV at position {position} (block {block_id})"
                )
            if row.sample:
                sampled_req_ids.append(row.req_id)
                output_index = end - self.worker_num_prompt_tokens[row.req_id]
                sampled_token_ids.append(fake_token(row.req_id, output_index))

        assert set(self.worker_tables) == {request.req_id for request in self.scheduler.running}
        for req_id, table in self.worker_tables.items():
            assert table == self.kv.get_block_ids(req_id), f"{req_id}: worker and scheduler tables differ"
        return sampled_req_ids, sampled_token_ids

    # -- invariants --------------------------------------------------------------

    @invariant()
    def pool_references_are_the_running_tables(self) -> None:
        running_ids = {request.req_id for request in self.scheduler.running}
        tables = {req_id: blocks for req_id, blocks in self.kv.req_to_blocks.items() if blocks}
        assert set(tables) <= running_ids, "only running requests hold blocks"
        references = Counter(block.block_id for blocks in tables.values() for block in blocks)
        assert_pool_invariants(self.kv.block_pool, references)
        assert self.observer.pairs == cached_pairs(self.kv.block_pool)

    @invariant()
    def every_request_is_in_exactly_one_place(self) -> None:
        running_ids = [request.req_id for request in self.scheduler.running]
        waiting_ids = [request.req_id for request in self.scheduler.waiting]
        assert len(running_ids) <= self.scheduler_config.max_num_seqs
        assert set(self.scheduler.requests) == {
            req_id for req_id, request in self.requests.items() if not request.is_finished
        }
        for req_id, request in self.requests.items():
            places = running_ids.count(req_id) + waiting_ids.count(req_id) + request.is_finished
            assert places == 1, f"{req_id} is in {places} places ({request.status.name})"
            if req_id in running_ids:
                assert request.status is RequestStatus.RUNNING
                assert len(self.kv.get_block_ids(req_id)) == ceil_div(request.num_computed_tokens, BLOCK_SIZE)
            elif req_id in waiting_ids:
                assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                assert request.num_computed_tokens == 0
                assert self.kv.get_block_ids(req_id) == []
            else:
                assert self.kv.get_block_ids(req_id) == []

    @invariant()
    def outputs_are_what_the_fake_model_samples(self) -> None:
        for req_id, request in self.requests.items():
            outputs = request.output_token_ids
            assert outputs == [fake_token(req_id, i) for i in range(len(outputs))]
            assert request.all_token_ids == request.prompt_token_ids + outputs
            assert len(outputs) <= request.sampling_params.max_tokens
            assert all(token not in request.stop_token_ids for token in outputs[:-1])
            reason = request.finish_reason
            if reason is FinishReason.STOP:
                assert outputs[-1] in request.stop_token_ids
            elif reason is FinishReason.LENGTH:
                assert (
                    len(outputs) == request.sampling_params.max_tokens
                    or request.num_tokens >= MAX_MODEL_LEN
                )
            elif reason is None:
                assert len(outputs) < request.sampling_params.max_tokens
                assert not outputs or outputs[-1] not in request.stop_token_ids

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        self.scheduler.abort_requests(list(self.scheduler.requests))
        assert not self.scheduler.has_unfinished_requests()
        assert self.scheduler.running == [] and list(self.scheduler.waiting) == []
        pool = self.kv.block_pool
        assert_pool_invariants(pool, {})
        assert pool.get_num_free_blocks() == pool.num_blocks - 1
        plan = self.scheduler.schedule()
        assert plan.req_ids == [] and plan.new_requests == [] and plan.preempted_req_ids == []
        assert sorted(plan.finished_req_ids) == sorted(self.worker_tables)


SchedulerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestSchedulerStateMachine = SchedulerMachine.TestCase
