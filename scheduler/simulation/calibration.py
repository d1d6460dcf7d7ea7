"""Calibrating the step cost model on a real replica.

``calibrate`` drives an ``Executor`` (the real workers of one replica) through
the replica's ``EngineCore`` with plans of varied shapes from a real
``Scheduler``, times each step's execution, and fits a ``StepCostModel``.  It imports nothing heavy: the executor is built by the
caller (``python -m kvserve.bench.calibrate_cost_model`` builds a
``kvserve.LLM``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.engine_core import EngineCore
from kvserve.scheduler.executor import Executor
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.cost_model import StepCostModel, StepSample, StepShape
from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CalibrationGrid:
    """The step shapes ``calibrate`` measures.

    Pure prefills of each length in ``prefill_lengths``; decodes of each
    batch size in ``decode_batches`` at each context in ``context_lengths``;
    and each decode batch with a prefill of the longest length mixed in.
    Each shape is timed ``repeats`` times.
    """

    prefill_lengths: tuple[int, ...] = (16, 64, 256, 512, 1024)
    decode_batches: tuple[int, ...] = (1, 4, 16, 32)
    context_lengths: tuple[int, ...] = (64, 256, 512)
    repeats: int = 3


def calibrate(
    executor: Executor,
    *,
    block_size: int = 16,
    vocab_size: int = 1000,
    grid: CalibrationGrid | None = None,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[StepCostModel, list[StepSample]]:
    """Measure steps of varied shapes on ``executor`` and fit a cost model.

    Plans come from a real ``Scheduler`` (prefix caching off, so every
    prompt token is computed) over random prompts; the first step is a
    warm-up and is not kept.  Each shape is measured ``grid.repeats`` times
    and fitted at its median.  Returns the model and the samples it was
    fitted to (one per shape).
    """
    grid = grid or CalibrationGrid()
    rng = random.Random(seed)
    longest = max(max(grid.prefill_lengths), max(grid.context_lengths))
    max_model_len = longest + 64 * max(grid.repeats, 1) + 64
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max(longest, max(grid.decode_batches)) + max(grid.decode_batches),
            max_num_seqs=max(grid.decode_batches) + 1,
            max_model_len=max_model_len,
        ),
        CacheConfig(block_size=block_size, num_blocks=executor.num_kv_blocks, enable_prefix_caching=False),
    )
    timed = _TimedExecutor(executor, clock)
    engine = EngineCore(scheduler, timed)
    counter = iter(range(1 << 62))

    def add(length: int, max_tokens: int) -> str:
        req_id = f"calib-{next(counter)}"
        prompt = [rng.randrange(3, vocab_size) for _ in range(length)]
        engine.add_request(Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        return req_id

    def measured_step() -> StepSample:
        timed.last = None
        engine.step()
        if timed.last is None:
            raise RuntimeError("calibration scheduled an empty step")
        plan, seconds = timed.last
        return StepSample(StepShape.of(plan), seconds)

    def drain() -> None:
        engine.abort_requests(list(scheduler.requests))
        engine.step()  # carries the finished ids to the workers

    samples: list[StepSample] = []
    add(min(grid.prefill_lengths), 1)
    engine.step()  # warm-up
    drain()
    for _ in range(grid.repeats):
        for length in grid.prefill_lengths:
            add(length, 1)
            samples.append(measured_step())
            drain()
        for context in grid.context_lengths:
            for batch in grid.decode_batches:
                for _ in range(batch):
                    add(context, 1 << 20)
                while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.requests.values()):
                    engine.step()
                samples.append(measured_step())
                add(max(grid.prefill_lengths), 1)
                samples.append(measured_step())
                drain()
    samples = median_per_shape(samples)
    model = StepCostModel.fit(samples)
    logger.info("calibrated %s from %d step shapes", model, len(samples))
    return model, samples


class _TimedExecutor:
    """``executor``, remembering its last plan and how long executing it took on ``clock``."""

    def __init__(self, executor: Executor, clock: Callable[[], float]) -> None:
        self._executor = executor
        self._clock = clock
        self.last: tuple[StepPlan, float] | None = None

    @property
    def num_kv_blocks(self) -> int:
        return self._executor.num_kv_blocks

    def execute(self, plan: StepPlan) -> StepResult:
        start = self._clock()
        result = self._executor.execute(plan)
        self.last = (plan, self._clock() - start)
        return result

    def shutdown(self) -> None:
        self._executor.shutdown()


def median_per_shape(samples: Sequence[StepSample]) -> list[StepSample]:
    """One sample per distinct shape, at the median of its measured times (robust to stalls)."""
    by_shape: dict[StepShape, list[float]] = {}
    for sample in samples:
        by_shape.setdefault(sample.shape, []).append(sample.seconds)
    return [StepSample(shape, float(np.median(times))) for shape, times in by_shape.items()]
