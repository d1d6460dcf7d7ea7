"""``Scheduler.get_load``: the O(1) snapshot always equals what a full scan computes."""

from __future__ import annotations

from hypothesis import given, settings

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.scheduler_load import SchedulerLoad
from kvserve.scheduler.step_plan import StepPlan
from tests.scheduler.scheduler_operations import OPERATIONS, SHAPES, run_operations, scheduler_config

BLOCK_SIZE = 4


def scanned_load(scheduler: Scheduler) -> SchedulerLoad:
    """The load from a scan of the queues."""
    stats = scheduler.get_stats()
    return SchedulerLoad(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_queued_prefill_tokens=stats.num_queued_prefill_tokens,
        num_running_tokens=sum(r.num_computed_tokens for r in scheduler.running),
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=scheduler.cache_config.num_usable_blocks,
    )


@settings(max_examples=150, deadline=None)
@given(operations=OPERATIONS, **SHAPES)
def test_load_snapshot_matches_a_full_scan_after_every_operation(
    operations: list[tuple], budget: int, max_num_seqs: int, num_blocks: int, chunk: int | None
) -> None:
    scheduler = Scheduler(
        scheduler_config(budget, max_num_seqs, chunk), CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks)
    )

    def check(plan: StepPlan | None) -> None:
        assert scheduler.get_load() == scanned_load(scheduler)

    run_operations(scheduler, operations, check)


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

    scheduler.update(scheduler.schedule(), [])

    load = scheduler.get_load()
    assert (load.num_queued_prefill_tokens, load.num_running_tokens, load.num_running) == (12, 8, 1)
