"""``Scheduler.get_load``: the O(1) snapshot always equals what a full scan computes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.scheduler_load import SchedulerLoad
from kvserve.scheduler.step_plan import StepPlan

BLOCK_SIZE = 4

# Each operation: ("add", prompt, max_tokens) | ("step", num_steps) | ("abort", which) | ("abort_in_flight", which)
OPERATIONS = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.lists(st.integers(0, 2), min_size=1, max_size=20),
            st.integers(1, 8),
        ),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
        st.tuples(st.just("abort_in_flight"), st.integers(0, 1000)),
    ),
    max_size=40,
)


def scanned_load(scheduler: Scheduler, in_flight: StepPlan | None = None) -> SchedulerLoad:
    """The load from a scan of the queues; ``in_flight``: the plan scheduled and not yet updated."""
    stats = scheduler.get_stats()
    # The cached-token estimates are the waiting requests' own, and only theirs.
    estimates = scheduler._waiting_cached_tokens
    assert set(estimates) <= {r.req_id for r in scheduler.waiting}
    assert all(0 < n < r.num_tokens for r in scheduler.waiting if (n := estimates.get(r.req_id, 0)))
    return SchedulerLoad(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_queued_prefill_tokens=stats.num_queued_prefill_tokens,
        num_running_tokens=sum(r.num_computed_tokens for r in scheduler.running),
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=scheduler.cache_config.num_usable_blocks,
        num_queued_cached_tokens=sum(estimates.values()),
        num_inflight_prefill_tokens=sum(n for n in in_flight.num_scheduled_tokens if n > 1) if in_flight else 0,
    )


def fake_tokens(plan_num_sampled: int) -> list[int]:
    return [7] * plan_num_sampled


@settings(max_examples=150, deadline=None)
@given(
    operations=OPERATIONS,
    budget=st.integers(2, 16),
    max_num_seqs=st.integers(1, 4),
    num_blocks=st.integers(6, 12),
    chunk=st.none() | st.integers(1, 6),
)
def test_load_snapshot_matches_a_full_scan_after_every_operation(
    operations: list[tuple], budget: int, max_num_seqs: int, num_blocks: int, chunk: int | None
) -> None:
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=32,
            long_prefill_token_threshold=chunk,
        ),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
    )
    num_added = 0
    for operation in operations:
        kind = operation[0]
        if kind == "add":
            request = Request(f"r{num_added}", operation[1], SamplingParams(max_tokens=operation[2], ignore_eos=True))
            if num_added % 2:  # as a router would: hashes filled before queueing
                request.block_hashes.extend(scheduler.kv_cache_manager.hasher.hash_token_ids(operation[1]))
            num_added += 1
            try:
                scheduler.add_request(request)
            except ValueError:
                pass  # too big for the pool: rejected, nothing changes
        elif kind == "step":
            for _ in range(operation[1]):
                plan = scheduler.schedule()
                assert scheduler.get_load() == scanned_load(scheduler, plan)
                scheduler.update(plan, fake_tokens(plan.num_sampled))
        elif kind == "abort" and scheduler.requests:
            ids = sorted(scheduler.requests)
            scheduler.abort_requests([ids[operation[1] % len(ids)]])
        elif kind == "abort_in_flight":
            plan = scheduler.schedule()
            if plan.req_ids:
                scheduler.abort_requests([plan.req_ids[operation[1] % len(plan.req_ids)]])
            assert scheduler.get_load() == scanned_load(scheduler, plan)  # the step still computes them
            scheduler.update(plan, fake_tokens(plan.num_sampled))
        assert scheduler.get_load() == scanned_load(scheduler)


def test_load_snapshot_of_an_idle_scheduler_is_empty() -> None:
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(block_size=16, num_blocks=10))

    assert scheduler.get_load() == SchedulerLoad(0, 0, 0, 0, 9, 9)


def test_queued_prefill_tokens_shrink_by_the_chunk_scheduled() -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8, max_model_len=64),
        CacheConfig(block_size=4, num_blocks=32),
    )
    scheduler.add_request(Request("a", list(range(20)), SamplingParams(max_tokens=2)))
    assert scheduler.get_load().num_queued_prefill_tokens == 20

    plan = scheduler.schedule()
    assert scheduler.get_load().num_inflight_prefill_tokens == 8  # the chunk the step in flight computes
    scheduler.update(plan, [])

    load = scheduler.get_load()
    assert (load.num_queued_prefill_tokens, load.num_running_tokens, load.num_running) == (12, 8, 1)
    assert load.num_inflight_prefill_tokens == 0


def test_a_waiting_request_whose_prefix_is_cached_counts_its_cached_tokens_until_scheduled() -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(block_size=4, num_blocks=32),
    )
    hasher = scheduler.kv_cache_manager.hasher
    prompt = list(range(3, 23))  # 20 tokens, 5 blocks
    scheduler.add_request(Request("a", prompt, SamplingParams(max_tokens=1)))
    scheduler.update(scheduler.schedule(), [9])  # "a" computes and caches its prompt, then finishes

    again = Request("b", prompt + [30, 31], SamplingParams(max_tokens=1))
    again.block_hashes.extend(hasher.hash_token_ids(again.prompt_token_ids))
    scheduler.add_request(again)
    load = scheduler.get_load()

    assert (load.num_queued_prefill_tokens, load.num_queued_cached_tokens) == (22, 20)
    scheduler.schedule()
    assert scheduler.get_load().num_queued_cached_tokens == 0
