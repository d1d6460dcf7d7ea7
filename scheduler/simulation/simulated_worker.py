"""A worker that runs no model, for live clusters of simulated replicas.

It stands in for ``kvserve.worker.worker.Worker`` behind the cluster's
StepWorker gRPC server (it has the servicer's ``StepRunner`` shape), so that
routing and scheduling can be exercised on real Ray and gRPC with dozens of
replicas on one machine: no torch, no weights, no KV tensors.  Each step
lasts the cost model's time on the worker thread (``SimulatedExecutor``) and
rank 0 answers with the simulator's synthetic tokens, so a live run and the
discrete-event simulator sample the same tokens for the same request ids.

NOTE: it lives here, not in ``worker/`` or ``cluster/``: it is plain Python
built from this package's simulated executor, and the cluster only picks it
when ``WorkerActor.start`` is given a ``SimulatedWorkerConfig``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvserve.scheduler.checks import check_num_blocks
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.simulation.simulated_executor import FIRST_SYNTHETIC_TOKEN_ID, SimulatedExecutor
from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult


@dataclass(frozen=True, slots=True)
class SimulationConfig:
    """How the replicas of a live cluster are simulated (``ClusterConfig.simulation``).

    A step lasts ``time_scale * cost_model.step_time(plan)`` seconds.  Sampled
    tokens are synthetic ids in ``[3, vocab_size)`` (``None``: the model's
    vocabulary, filled in when the cluster starts).  ``scripted_output_token_ids``
    gives the tokens some requests (by request id) answer with instead: a
    multi-turn workload whose next prompt repeats the previous answer replays
    live only if the answer is the one its prompt expects.
    """

    cost_model: StepCostModel = field(default_factory=StepCostModel.default)
    time_scale: float = 1.0
    vocab_size: int | None = None
    scripted_output_token_ids: Mapping[str, Sequence[int]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not isinstance(self.cost_model, StepCostModel):
            raise ValueError(f"cost_model must be a StepCostModel, got {type(self.cost_model).__name__}")
        scale = self.time_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
            raise ValueError(f"time_scale must be a finite number >= 0, got {scale!r}")
        vocab_size = self.vocab_size
        if vocab_size is not None and (
            isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= FIRST_SYNTHETIC_TOKEN_ID
        ):
            raise ValueError(f"vocab_size must be an integer > {FIRST_SYNTHETIC_TOKEN_ID} or None, got {vocab_size!r}")
        if vocab_size is not None:
            for req_id, token_ids in self.scripted_output_token_ids.items():
                if token_ids and not 0 <= min(token_ids) <= max(token_ids) < vocab_size:
                    raise ValueError(
                        f"scripted_output_token_ids[{req_id!r}] has ids outside the vocabulary [0, {vocab_size})"
                    )


@dataclass(frozen=True, slots=True)
class SimulatedWorkerConfig:
    """How to start one rank of a simulated replica (what ``ClusterConfig.worker_config()`` yields).

    ``num_blocks`` is the pool size the rank reports, null block included.
    """

    simulation: SimulationConfig
    num_blocks: int
    rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.simulation.vocab_size is None:
            raise ValueError("a simulated worker needs simulation.vocab_size (the model's vocabulary)")
        check_num_blocks(self.num_blocks)
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank must be in [0, {self.tp_size}), got {self.rank}")


class SimulatedWorker:
    """One rank of a simulated replica: sleeps each step's modelled time; rank 0 samples.

    Every rank sleeps (the ranks of a real replica step together); only rank
    0 returns a ``StepResult``, the others ``None``, as ``Worker`` does.  A
    step that continues the previous one is timed from that one's end on
    ``clock``, so Ray's and gRPC's time between steps is not added to the
    model's (see ``SimulatedExecutor``); ``clock=None`` sleeps every step in full.
    """

    def __init__(
        self,
        config: SimulatedWorkerConfig,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] | None = time.monotonic,
    ) -> None:
        simulation = config.simulation
        self.config = config
        self._executor = SimulatedExecutor(
            simulation.cost_model,
            config.num_blocks,
            vocab_size=simulation.vocab_size,  # type: ignore[arg-type]  # checked by the config
            time_scale=simulation.time_scale,
            sleep=sleep,
            clock=clock,
        )
        self._scripts = simulation.scripted_output_token_ids
        # Prompt lengths of the scripted requests in flight: the n-th sampled
        # token of a request sits at position num_prompt_tokens + n.
        self._num_prompt_tokens: dict[str, int] = {}
        self.num_cache_blocks: int | None = None

    def determine_num_blocks(self) -> int:
        return self._executor.num_kv_blocks

    def initialize_cache(self, num_blocks: int) -> None:
        if not 2 <= num_blocks <= self._executor.num_kv_blocks:
            raise ValueError(f"num_blocks must be in [2, {self._executor.num_kv_blocks}], got {num_blocks}")
        self.num_cache_blocks = num_blocks

    def execute(self, plan: StepPlan) -> StepResult | None:
        if self.num_cache_blocks is None:
            raise RuntimeError("initialize_cache() must run before the first step")
        result = self._executor.execute(plan)
        if self.config.rank != 0:
            return None
        if self._scripts:
            result = self._apply_scripts(plan, result)
        return result

    def shutdown(self) -> None:
        self._executor.shutdown()

    def _apply_scripts(self, plan: StepPlan, result: StepResult) -> StepResult:
        """``result`` with the scripted requests' tokens in place of the synthetic ones."""
        scripts = self._scripts
        num_prompt_tokens = self._num_prompt_tokens
        for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
            num_prompt_tokens.pop(req_id, None)
        for new in plan.new_requests:
            if new.req_id in scripts:
                num_prompt_tokens[new.req_id] = new.num_prompt_tokens
        tokens = list(result.sampled_token_ids)
        row = 0
        for req_id, start, num_tokens, sample in zip(
            plan.req_ids, plan.num_computed_tokens, plan.num_scheduled_tokens, plan.sample
        ):
            if not sample:
                continue
            script = scripts.get(req_id)
            if script is not None:
                output_index = start + num_tokens - num_prompt_tokens[req_id]
                if output_index < len(script):
                    tokens[row] = script[output_index]
            row += 1
        return StepResult(result.step_id, tokens, result.logprobs)
