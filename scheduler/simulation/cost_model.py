"""How long one step of one replica takes: a linear model of the plan's shape.

    step time = a + b * prefill tokens + c * decode requests + d * context tokens

* ``a``: fixed cost of a forward pass (weights read once, launches, sampling);
* ``b``: per prompt token computed (the compute-bound part of prefill);
* ``c``: per request decoding one token;
* ``d``: per token of KV context read by attention (the memory-bound part of decode).

A plan row scheduling one token is a decode; a row scheduling more is a
prefill chunk.  The context of a row is its length after the step
(``num_computed_tokens + num_scheduled_tokens``).

The coefficients come from ``fit`` over measured steps (``calibrate`` measures
a real replica through its ``Executor``; ``python -m
kvserve.bench.calibrate_cost_model`` runs it on a model) and are saved as JSON.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.executor import Executor
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.step_plan import StepPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepShape:
    """The features of one step the cost model prices."""

    num_prefill_tokens: int
    num_decode_requests: int
    num_context_tokens: int

    @classmethod
    def of(cls, plan: StepPlan) -> StepShape:
        num_decodes = plan.num_scheduled_tokens.count(1)
        return cls(
            num_prefill_tokens=len(plan.token_ids) - num_decodes,
            num_decode_requests=num_decodes,
            num_context_tokens=sum(plan.num_computed_tokens) + len(plan.token_ids),
        )


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured step: its shape and how long it took, in seconds."""

    shape: StepShape
    seconds: float


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """Seconds per step: ``a + b * prefill tokens + c * decode requests + d * context tokens``."""

    a: float
    b: float
    c: float
    d: float

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "d"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
                raise ValueError(f"cost model coefficient {name} must be finite and >= 0, got {value!r}")
        if self.a == 0 and self.b == 0 and self.c == 0 and self.d == 0:
            raise ValueError("cost model coefficients must not all be zero: steps would take no time")

    @classmethod
    def default(cls) -> StepCostModel:
        """An 8B-parameter model on one H100, from first principles (not measured).

        a: 16 GB of bf16 weights read at ~3 TB/s plus launches, ~7 ms;
        b: ~16 GFLOP per token at ~300 TFLOP/s effective, 50 us;
        c: a decode token's compute and sampling, 60 us;
        d: 128 KiB of KV per token read at ~3 TB/s, 40 ns.
        """
        return cls(a=7e-3, b=5e-5, c=6e-5, d=4e-8)

    def step_time(self, plan: StepPlan) -> float:
        """Modelled seconds for ``plan``; 0 for a plan that schedules nothing."""
        num_tokens = len(plan.token_ids)
        if not num_tokens:
            return 0.0
        num_decodes = plan.num_scheduled_tokens.count(1)
        return (
            self.a
            + self.b * (num_tokens - num_decodes)
            + self.c * num_decodes
            + self.d * (sum(plan.num_computed_tokens) + num_tokens)
        )

    def shape_time(self, shape: StepShape) -> float:
        return (
            self.a
            + self.b * shape.num_prefill_tokens
            + self.c * shape.num_decode_requests
            + self.d * shape.num_context_tokens
        )

    # -- fitting and persistence ---------------------------------------------------

    @classmethod
    def fit(cls, samples: Sequence[StepSample]) -> StepCostModel:
        """Least-squares coefficients over ``samples``, none negative.

        Coefficients that come out negative (noise on a term too small to
        measure) are fixed at zero and the rest refitted.
        """
        if len(samples) < 4:
            raise ValueError(f"need at least 4 measured steps to fit 4 coefficients, got {len(samples)}")
        features = np.array(
            [
                [1.0, s.shape.num_prefill_tokens, s.shape.num_decode_requests, s.shape.num_context_tokens]
                for s in samples
            ]
        )
        seconds = np.array([s.seconds for s in samples])
        active = [0, 1, 2, 3]
        coefficients = np.zeros(4)
        while active:
            solution, *_ = np.linalg.lstsq(features[:, active], seconds, rcond=None)
            if (solution >= 0).all():
                coefficients[active] = solution
                break
            # Drop the most negative coefficient and refit the others.
            active.pop(int(np.argmin(solution)))
        return cls(*(float(x) for x in coefficients))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> StepCostModel:
        data = json.loads(text)
        missing = {"a", "b", "c", "d"} - set(data)
        if missing:
            raise ValueError(f"cost model JSON lacks {sorted(missing)}")
        return cls(**{key: float(data[key]) for key in ("a", "b", "c", "d")})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        return cls.from_json(Path(path).read_text())


# -- measuring a real replica ------------------------------------------------------


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
    counter = iter(range(1 << 62))

    def add(length: int, max_tokens: int) -> str:
        req_id = f"calib-{next(counter)}"
        prompt = [rng.randrange(3, vocab_size) for _ in range(length)]
        scheduler.add_request(Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        return req_id

    def run(plan: StepPlan) -> float:
        start = clock()
        result = executor.execute(plan)
        seconds = clock() - start
        scheduler.update(plan, result.sampled_token_ids)
        return seconds

    def drain() -> None:
        scheduler.abort_requests(list(scheduler.requests))
        plan = scheduler.schedule()  # carries the finished ids to the workers
        if not plan.is_empty:
            executor.execute(plan)

    samples: list[StepSample] = []
    add(min(grid.prefill_lengths), 1)
    run(scheduler.schedule())  # warm-up
    drain()
    for _ in range(grid.repeats):
        for length in grid.prefill_lengths:
            add(length, 1)
            plan = scheduler.schedule()
            samples.append(StepSample(StepShape.of(plan), run(plan)))
            drain()
        for context in grid.context_lengths:
            for batch in grid.decode_batches:
                for _ in range(batch):
                    add(context, 1 << 20)
                while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.requests.values()):
                    run(scheduler.schedule())
                plan = scheduler.schedule()
                samples.append(StepSample(StepShape.of(plan), run(plan)))
                add(max(grid.prefill_lengths), 1)
                plan = scheduler.schedule()
                samples.append(StepSample(StepShape.of(plan), run(plan)))
                drain()
    samples = median_per_shape(samples)
    model = StepCostModel.fit(samples)
    logger.info("calibrated %s from %d step shapes", model, len(samples))
    return model, samples


def median_per_shape(samples: Sequence[StepSample]) -> list[StepSample]:
    """One sample per distinct shape, at the median of its measured times (robust to stalls)."""
    by_shape: dict[StepShape, list[float]] = {}
    for sample in samples:
        by_shape.setdefault(sample.shape, []).append(sample.seconds)
    return [StepSample(shape, float(np.median(times))) for shape, times in by_shape.items()]
