"""EngineCore with more than one launched step left in flight (``steps_ahead``)."""

from __future__ import annotations

import pytest

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.engine_core import EngineCore
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.simulation.simulated_executor import synthetic_step_result
from kvserve.scheduler.step_plan import StepPlan


class Launched:
    def __init__(self, plan: StepPlan, fails: bool) -> None:
        self.plan, self.fails = plan, fails

    def result(self):
        if self.fails:
            raise RuntimeError(f"step {self.plan.step_id} failed on the device")
        return synthetic_step_result(self.plan, 100)


class LaunchingExecutor:
    """Launches return at once; the step ids in ``failing`` fail when their result is asked for."""

    launches_ahead = True

    def __init__(self, steps_ahead: int | None = None, failing: frozenset[int] = frozenset()) -> None:
        if steps_ahead is not None:
            self.steps_ahead = steps_ahead
        self.failing = failing
        self.launched: list[int] = []

    def launch(self, plan: StepPlan) -> Launched:
        self.launched.append(plan.step_id)
        return Launched(plan, plan.step_id in self.failing)

    def execute(self, plan: StepPlan):
        return self.launch(plan).result()

    def shutdown(self) -> None:
        pass


def scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64),
                     CacheConfig(block_size=4, num_blocks=64))


def test_the_engine_keeps_as_many_steps_in_flight_as_the_executor_asks() -> None:
    engine = EngineCore(scheduler(), LaunchingExecutor(steps_ahead=3))
    assert engine.async_scheduling and engine.steps_ahead == 3
    engine.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True)))
    outputs = [engine.step() for _ in range(4)]
    # Three calls fill the pipeline; the fourth applies the first step: a's first token.
    assert outputs[:3] == [[], [], []] and [o.req_id for o in outputs[3]] == ["a"]
    assert engine.num_steps_in_flight == 3
    tokens = [o.token_id for step in outputs for o in step]
    while engine.has_unfinished_requests():
        tokens += [o.token_id for o in engine.step()]
    assert len(tokens) == 10 and engine.num_steps_in_flight == 0
    assert EngineCore(scheduler(), LaunchingExecutor()).steps_ahead == 1  # executors that do not ask: one


@pytest.mark.parametrize("steps_ahead", [0, -1, True, 1.5, "2"])
def test_a_steps_ahead_that_is_not_a_positive_integer_is_refused(steps_ahead) -> None:
    with pytest.raises(ValueError, match="steps_ahead must be an integer >= 1"):
        EngineCore(scheduler(), LaunchingExecutor(), steps_ahead=steps_ahead)


def test_a_failed_step_fails_every_step_in_flight_behind_it() -> None:
    executor = LaunchingExecutor(steps_ahead=2, failing=frozenset({1}))
    engine = EngineCore(scheduler(), executor)
    for i in range(3):
        engine.add_request(Request(f"r{i}", [1, 2, 3 + i], SamplingParams(max_tokens=20, ignore_eos=True)))
    with pytest.raises(RuntimeError, match="step 1 failed on the device"):
        for _ in range(10):
            engine.step()
    # Steps 2 and 3 were in flight behind step 1: none of their tokens come, their requests end.
    assert executor.launched[:4] == [0, 1, 2, 3]
    assert engine.num_steps_in_flight == 0 and not engine.has_unfinished_requests()
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_usable_blocks  # every block back
