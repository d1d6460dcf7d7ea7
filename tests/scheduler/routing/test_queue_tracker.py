"""``QueueTracker``: the router's count of a replica's queued cached tokens and in-flight prefill,
from the scheduler's events and the global prefix index."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings

from kvserve.scheduler.block_hash import BlockHash
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.request import Request
from kvserve.scheduler.routing.queue_tracker import QueueTracker
from kvserve.scheduler.routing.round_robin import RoundRobinPolicy
from kvserve.scheduler.routing.router import Router
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.step_plan import StepPlan
from tests.scheduler.scheduler_operations import OPERATIONS, SHAPES, run_operations, scheduler_config

BLOCK_SIZE = 4


class PoolLookup:
    """The reference: each queued request looked up in the replica's own pool when it is queued."""

    def __init__(self, tracker: QueueTracker) -> None:
        self.tracker = tracker
        self.scheduler: Scheduler | None = None
        self.cached: dict[str, int] = {}

    def request_queued(self, req_id: str, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        pool = self.scheduler.kv_cache_manager.block_pool  # type: ignore[union-attr]
        num_blocks = 0
        for block_hash in block_hashes[: (num_tokens - 1) // BLOCK_SIZE]:
            if pool.get_cached_block(block_hash) is None:
                break
            num_blocks += 1
        if num_blocks:
            self.cached[req_id] = num_blocks * BLOCK_SIZE
        self.tracker.request_queued(req_id, block_hashes, num_tokens)

    def request_dequeued(self, req_id: str) -> None:
        self.cached.pop(req_id, None)
        self.tracker.request_dequeued(req_id)

    def step_planned(self, num_prefill_tokens: int) -> None:
        self.tracker.step_planned(num_prefill_tokens)

    def step_applied(self) -> None:
        self.tracker.step_applied()


def tracked_scheduler(num_blocks: int = 32, **scheduler_args) -> tuple[Router, Scheduler, PoolLookup]:
    """A one-replica router and its scheduler, whose queue events pass through the reference lookup."""
    router = Router(1, RoundRobinPolicy(), BLOCK_SIZE)
    reference = PoolLookup(router.queue_observer_for(0))
    scheduler = Scheduler(
        SchedulerConfig(**scheduler_args),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        observer=router.observer_for(0),
        queue_observer=reference,
    )
    reference.scheduler = scheduler
    return router, scheduler, reference


def check(router: Router, scheduler: Scheduler, reference: PoolLookup, in_flight: StepPlan | None = None) -> None:
    tracker = reference.tracker
    router.update_load(0, scheduler.get_load())
    load = router.loads[0]
    # The index's lookup finds what the pool's own would have, for waiting requests only.
    assert tracker.queued_cached_tokens == reference.cached
    assert set(reference.cached) <= {r.req_id for r in scheduler.waiting}
    assert all(0 < n < r.num_tokens for r in scheduler.waiting if (n := reference.cached.get(r.req_id, 0)))
    assert load.num_queued_cached_tokens == sum(reference.cached.values())
    inflight = sum(n for n in in_flight.num_scheduled_tokens if n > 1) if in_flight else 0
    assert load.num_inflight_prefill_tokens == inflight


@settings(max_examples=150, deadline=None)
@given(operations=OPERATIONS, **SHAPES)
def test_tracked_figures_match_a_pool_lookup_at_queueing_after_every_operation(
    operations: list[tuple], budget: int, max_num_seqs: int, num_blocks: int, chunk: int | None
) -> None:
    router = Router(1, RoundRobinPolicy(), BLOCK_SIZE)
    reference = PoolLookup(router.queue_observer_for(0))
    scheduler = Scheduler(
        scheduler_config(budget, max_num_seqs, chunk),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        observer=router.observer_for(0),
        queue_observer=reference,
    )
    reference.scheduler = scheduler

    run_operations(scheduler, operations, lambda plan: check(router, scheduler, reference, plan))


def test_the_step_in_flight_counts_its_prefill_chunk_until_applied() -> None:
    router, scheduler, reference = tracked_scheduler(max_num_batched_tokens=8, max_model_len=64)
    scheduler.add_request(Request("a", list(range(20)), SamplingParams(max_tokens=2)))

    plan = scheduler.schedule()
    assert reference.tracker.num_inflight_prefill_tokens == 8  # the chunk the step in flight computes
    scheduler.update(plan, [])
    assert reference.tracker.num_inflight_prefill_tokens == 0


def test_every_step_in_flight_counts_its_prefill_chunk_until_applied_or_discarded() -> None:
    # Async scheduling, two steps ahead: steps are planned before the ones before are applied.
    router, scheduler, reference = tracked_scheduler(max_num_batched_tokens=8, max_model_len=64)
    scheduler.add_request(Request("a", list(range(20)), SamplingParams(max_tokens=1)))
    tracker = reference.tracker

    first, second = scheduler.schedule(), scheduler.schedule()
    assert tracker.num_inflight_prefill_tokens == 16  # two chunks of 8
    third = scheduler.schedule()  # the prompt's last 4 tokens
    assert tracker.num_inflight_prefill_tokens == 20
    scheduler.update(first, [])
    assert tracker.num_inflight_prefill_tokens == 12
    assert scheduler.schedule().is_empty  # "a"'s one token is on its way: nothing to plan, nothing runs
    assert tracker.num_inflight_prefill_tokens == 12
    scheduler.update(second, [])
    scheduler.discard_step(third)  # failed on the workers: no longer in flight either
    assert tracker.num_inflight_prefill_tokens == 0


def test_a_waiting_request_whose_prefix_is_cached_counts_its_cached_tokens_until_scheduled() -> None:
    router, scheduler, reference = tracked_scheduler(max_num_batched_tokens=64, max_model_len=64)
    prompt = list(range(3, 23))  # 20 tokens, 5 blocks
    scheduler.add_request(Request("a", prompt, SamplingParams(max_tokens=1)))
    scheduler.update(scheduler.schedule(), [9])  # "a" computes and caches its prompt, then finishes

    again = Request("b", prompt + [30, 31], SamplingParams(max_tokens=1))
    router.hash_prompt(again)
    scheduler.add_request(again)
    router.update_load(0, scheduler.get_load())

    assert (router.loads[0].num_queued_prefill_tokens, router.loads[0].num_queued_cached_tokens) == (22, 20)
    scheduler.schedule()
    router.update_load(0, scheduler.get_load())
    assert router.loads[0].num_queued_cached_tokens == 0


def test_a_prompt_held_whole_counts_all_but_its_last_tokens_block() -> None:
    router, scheduler, reference = tracked_scheduler(max_num_batched_tokens=64, max_model_len=64)
    prompt = list(range(3, 19))  # 16 tokens, 4 full blocks
    scheduler.add_request(Request("a", prompt, SamplingParams(max_tokens=1)))
    scheduler.update(scheduler.schedule(), [9])

    scheduler.add_request(Request("b", prompt, SamplingParams(max_tokens=1)))

    assert reference.tracker.num_queued_cached_tokens == 12  # the last token is always computed


def test_a_new_scheduler_of_the_replica_gets_a_fresh_tracker() -> None:
    router, scheduler, reference = tracked_scheduler(max_num_batched_tokens=64, max_model_len=64)
    reference.tracker.step_planned(100)

    router.queue_observer_for(0)
    router.update_load(0, scheduler.get_load())

    assert router.loads[0].num_inflight_prefill_tokens == 0
