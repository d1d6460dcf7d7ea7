"""The discrete-event fleet simulator: exact timing, determinism, caching across turns."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.routing.policies import make_policy
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.simulation.simulator import FleetConfig, FleetSimulator

MODEL = StepCostModel(a=0.01, b=1e-4, c=1e-3, d=0.0)
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Item:
    arrival_time: float
    prompt_token_ids: Sequence[int]
    output_len: int
    cache_salt: str | None = None
    output_token_ids: Sequence[int] | None = None


def config(num_replicas: int = 2, num_blocks: int = 256) -> FleetConfig:
    return FleetConfig(
        num_replicas=num_replicas,
        scheduler_config=SchedulerConfig(max_num_batched_tokens=512, max_model_len=2048),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        cost_model=MODEL,
    )


def stream(num_requests: int, seed: int = 0) -> list[Item]:
    items = []
    for i in range(num_requests):
        group = (i * 7 + seed) % 5
        prefix = [3 + group] * 160
        items.append(Item(0.05 * i, prefix + [100 + i % 50] * (8 + i % 13), 4 + i % 9))
    return items


def test_a_lone_request_takes_one_prefill_step_then_one_step_per_token() -> None:
    result = FleetSimulator(config(1), make_policy("round_robin")).run([Item(1.0, [5] * 100, 3)])

    record = result.records[0]
    prefill = 0.01 + 100 * 1e-4
    decode = 0.01 + 1e-3
    assert record.ttft == pytest.approx(prefill)
    assert record.latency == pytest.approx(prefill + 2 * decode)
    assert (record.num_prompt_tokens, record.num_cached_tokens, record.num_output_tokens) == (100, 0, 3)
    assert result.replica_busy_time == [pytest.approx(prefill + 2 * decode)]
    assert result.replica_num_steps == [3]


@pytest.mark.parametrize("policy", ["least_loaded", "consistent_hash", "cache_aware", "cost_ttft"])
def test_the_same_seed_gives_the_same_simulation(policy: str) -> None:
    runs = [
        FleetSimulator(config(3, num_blocks=40), make_policy(policy)).run(stream(120)) for _ in range(2)
    ]

    assert runs[0] == runs[1]  # every record, every replica total (wall time excluded)
    assert all(r.num_output_tokens == 4 + r.index % 9 for r in runs[0].records)


def test_a_cache_aware_fleet_serves_shared_prefixes_from_the_cache() -> None:
    result = FleetSimulator(config(3), make_policy("cache_aware")).run(stream(60))

    cached = sum(r.num_cached_tokens for r in result.records[5:])
    assert cached >= 0.8 * sum(r.num_prompt_tokens for r in result.records[5:])


def test_the_next_turn_hits_the_answer_the_previous_turn_generated() -> None:
    answer = list(range(500, 532))  # 32 tokens: two blocks once all but the last are computed
    first = Item(0.0, [7] * 64, 32, output_token_ids=answer)
    second = Item(10.0, [7] * 64 + answer + [9] * 8, 2)

    result = FleetSimulator(config(1), make_policy("round_robin")).run([first, second])

    # The whole first prompt (4 blocks) and the answer's first block are cached.
    assert result.records[1].num_cached_tokens == 64 + 16


def test_cost_ttft_sends_a_later_request_for_a_long_prompt_to_the_replica_that_cached_it() -> None:
    document = [11] * 1536  # 3 steps of the 512-token budget
    first = Item(0.0, document + [1] * 16, 2)
    second = Item(1.0, document + [2] * 16, 2)  # the first has finished: its document is cached

    records = FleetSimulator(config(2), make_policy("cost_ttft")).run([first, second]).records

    assert records[1].replica_id == records[0].replica_id
    assert records[1].num_cached_tokens == len(document)
    assert records[1].ttft < records[0].ttft


def test_cost_ttft_does_not_queue_a_short_prompt_behind_a_replica_computing_a_long_one() -> None:
    # The second request shares one block with the document, which replica 0 is still computing:
    # waiting for that step costs more than computing 16 more tokens on the idle replica.
    document = [11] * 1536
    first = Item(0.0, document + [1] * 16, 2)
    second = Item(0.005, [11] * 16 + [2] * 32, 2)

    records = FleetSimulator(config(2), make_policy("cost_ttft")).run([first, second]).records

    assert records[1].replica_id != records[0].replica_id


def test_requests_must_arrive_in_order() -> None:
    with pytest.raises(ValueError, match="sorted by arrival"):
        FleetSimulator(config(1), make_policy("round_robin")).run([Item(2.0, [5] * 10, 1), Item(1.0, [5] * 10, 1)])


def test_a_request_too_big_for_a_replica_is_reported() -> None:
    with pytest.raises(ValueError, match="request 0 cannot be served"):
        FleetSimulator(config(1, num_blocks=4), make_policy("round_robin")).run([Item(0.0, [5] * 100, 1)])


def test_a_request_longer_than_max_model_len_is_reported_at_admission() -> None:
    # The scheduler stops it at max_model_len, short of its output_len tokens:
    # the run ended with "1 requests never finished (a replica stalled)".
    fleet = FleetConfig(
        num_replicas=1,
        scheduler_config=SchedulerConfig(max_num_batched_tokens=512, max_model_len=16),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, num_blocks=64),
        cost_model=MODEL,
    )
    with pytest.raises(ValueError, match="request 1 cannot be served: 10 prompt \\+ 10 output tokens exceed max_model_len=16"):
        FleetSimulator(fleet, make_policy("round_robin")).run([Item(0.0, [5] * 10, 6), Item(0.0, [5] * 10, 10)])


@pytest.mark.parametrize(
    ("arrival_times", "model"),
    [
        # A step of 1 ms is nothing at 1e19 s: requests got a TTFT and latency of 0.
        ([0.0, 1e19], MODEL),
        # Steps of 1e308 s overflow the clock: figures of inf and nan.
        ([0.0, 1.0], StepCostModel(a=1e308, b=0.0, c=0.0, d=0.0)),
    ],
)
def test_times_beyond_the_virtual_clocks_precision_are_reported(arrival_times, model) -> None:  # noqa: ANN001
    fleet = FleetConfig(
        num_replicas=1,
        scheduler_config=SchedulerConfig(max_num_batched_tokens=512, max_model_len=2048),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, num_blocks=64),
        cost_model=model,
    )
    items = [Item(t, [5] * 10, 2) for t in arrival_times]
    with pytest.raises(ValueError, match="the virtual clock cannot count a .* s step from .* s: arrival times or step costs"):
        FleetSimulator(fleet, make_policy("round_robin")).run(items)


def test_progress_is_reported_as_requests_finish() -> None:
    seen: list[tuple[int, int]] = []

    FleetSimulator(config(2), make_policy("round_robin")).run(stream(20), progress=lambda d, n: seen.append((d, n)), progress_every=5)

    assert seen == [(5, 20), (10, 20), (15, 20), (20, 20)]


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_cycle_collector_is_paused_during_a_run_and_restored_after(enabled_before: bool) -> None:
    enabled_during: list[bool] = []
    was_enabled = gc.isenabled()
    try:
        (gc.enable if enabled_before else gc.disable)()
        FleetSimulator(config(2), make_policy("round_robin")).run(
            stream(10), progress=lambda d, n: enabled_during.append(gc.isenabled()), progress_every=5
        )
        assert gc.isenabled() is enabled_before
    finally:
        (gc.enable if was_enabled else gc.disable)()
    assert enabled_during == [False, False]


def test_a_thousand_replicas_route_and_finish_every_request() -> None:
    result = FleetSimulator(config(1000, num_blocks=32), make_policy("cost_ttft")).run(stream(300))

    assert sum(result.replica_num_requests) == 300
    assert all(r.finish_time >= r.first_token_time >= r.arrival_time for r in result.records)
