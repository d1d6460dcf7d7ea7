"""Simulated executors: the cost model's time, deterministic synthetic tokens, the engine contract."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.scheduler.engine_core import EngineCore
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.simulation.simulated_executor import (
    AsyncSimulatedExecutor,
    SimulatedExecutor,
    synthetic_output_token_array,
    synthetic_token_id,
)

MODEL = StepCostModel(a=0.01, b=1e-4, c=1e-4, d=0.0)


def make_scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=128), CacheConfig(block_size=4, num_blocks=64))


def test_execute_sleeps_the_modelled_step_time_and_samples_synthetic_tokens() -> None:
    slept: list[float] = []
    executor = SimulatedExecutor(MODEL, num_kv_blocks=64, vocab_size=500, sleep=slept.append, time_scale=2.0)
    scheduler = make_scheduler()
    scheduler.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=3)))
    plan = scheduler.schedule()

    result = executor.execute(plan)

    assert slept == [pytest.approx(2.0 * (0.01 + 10 * 1e-4))]
    assert result.sampled_token_ids == [synthetic_token_id("a", 10, 500)]
    assert result.logprobs is None


def test_simulated_replicas_are_scheduled_plainly_unless_asked() -> None:
    """Their step times are modelled for plain scheduling: overlap is not the default."""
    executor = AsyncSimulatedExecutor(MODEL, num_kv_blocks=64, vocab_size=500)
    assert EngineCore(make_scheduler(), executor).async_scheduling is False
    assert EngineCore(make_scheduler(), SimulatedExecutor(MODEL, 64, vocab_size=500)).async_scheduling is False


def test_synthetic_tokens_are_deterministic_and_in_range() -> None:
    tokens = [synthetic_token_id("req-7", position, 50) for position in range(1000)]

    assert tokens == [synthetic_token_id("req-7", position, 50) for position in range(1000)]
    assert min(tokens) >= 3 and max(tokens) < 50
    assert len(set(tokens)) > 40
    assert synthetic_output_token_array("req-7", 10, 20, 50).tolist() == tokens[10:30]
    assert synthetic_output_token_array("req-7", 10, 0, 50).tolist() == []


def test_an_engine_on_a_simulated_executor_runs_requests_to_completion() -> None:
    engine = EngineCore(make_scheduler(), SimulatedExecutor(MODEL, 64, vocab_size=500, sleep=lambda s: None))
    for i in range(3):
        engine.add_request(Request(f"r{i}", list(range(5 + i)), SamplingParams(max_tokens=4, ignore_eos=True)))
    outputs: dict[str, list[int]] = {}

    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.setdefault(output.req_id, []).append(output.token_id)

    assert {req_id: len(tokens) for req_id, tokens in outputs.items()} == {"r0": 4, "r1": 4, "r2": 4}
    assert outputs["r0"] == [synthetic_token_id("r0", 5 + k, 500) for k in range(4)]


def test_async_executor_answers_after_the_modelled_time() -> None:
    executor = AsyncSimulatedExecutor(MODEL, num_kv_blocks=64, vocab_size=500, time_scale=0.0)
    scheduler = make_scheduler()
    scheduler.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=3)))

    result = asyncio.run(executor.execute(scheduler.schedule()))

    assert result.sampled_token_ids == [synthetic_token_id("a", 10, 500)]
    asyncio.run(executor.shutdown())
    with pytest.raises(RuntimeError):
        asyncio.run(executor.execute(scheduler.schedule()))


class FakeTime:
    """A clock that only sleeping, and the test, move."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now


def paced_executor(fake: FakeTime) -> SimulatedExecutor:
    return SimulatedExecutor(MODEL, num_kv_blocks=64, vocab_size=500, sleep=fake.sleep, clock=fake.clock)


def step(scheduler: Scheduler, executor: SimulatedExecutor) -> float:
    """Run one step; its modelled seconds."""
    plan = scheduler.schedule()
    scheduler.update(plan, executor.execute(plan).sampled_token_ids, [0.0] * sum(plan.sample))
    return MODEL.step_time(plan)


def test_a_step_that_continues_the_previous_one_is_timed_from_its_end() -> None:
    fake = FakeTime()
    executor = paced_executor(fake)
    scheduler = make_scheduler()
    scheduler.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=3, ignore_eos=True)))

    first = step(scheduler, executor)
    fake.now += 0.004  # the result's way back, the scheduler, the next plan's way out
    second = step(scheduler, executor)

    assert fake.slept == [pytest.approx(first), pytest.approx(second - 0.004)]
    # The two steps end when the model says, as in the simulator.
    assert fake.now == pytest.approx(first + second)


def test_a_step_after_an_idle_spell_sleeps_in_full_and_overhead_is_never_carried() -> None:
    fake = FakeTime()
    executor = paced_executor(fake)
    scheduler = make_scheduler()
    scheduler.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=1)))
    first = step(scheduler, executor)
    assert not scheduler.has_unfinished_requests()

    fake.now += 0.5  # idle: nothing to schedule until "b" comes
    scheduler.add_request(Request("b", list(range(10)), SamplingParams(max_tokens=3, ignore_eos=True)))
    second = step(scheduler, executor)
    fake.now += 1.0  # longer than a step: this one sleeps nothing, and the excess is not taken off the next
    step(scheduler, executor)
    fake.now += 0.001
    fourth = step(scheduler, executor)

    assert fake.slept == [pytest.approx(first), pytest.approx(second), pytest.approx(fourth - 0.001)]
    assert fake.slept[-1] > 0


def test_without_a_clock_every_step_sleeps_in_full() -> None:
    slept: list[float] = []
    executor = SimulatedExecutor(MODEL, num_kv_blocks=64, vocab_size=500, sleep=slept.append)
    scheduler = make_scheduler()
    scheduler.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=3, ignore_eos=True)))

    modelled = [step(scheduler, executor) for _ in range(3)]

    assert slept == [pytest.approx(seconds) for seconds in modelled]
