"""Where an end-to-end run's time went, step by step, against each step's own floor.

``StepTimes`` times every step a plain (not overlapped) engine runs: ``execute`` returns
after the device ran the step, so each step's seconds are its own.  ``roofline_rows``
then sums the steps by kind, each against its floor: the larger of its arithmetic at the
matmul rate and its memory traffic at the read rate::

    with prefill tokens   FLOPs = every token's matmuls + the prefill rows' (query, key) pairs
    decode only           bytes = the weights + every row's K/V (its context)

A kind's ``s / floor`` above the workload's says where the end-to-end gap comes from.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvserve.bench.serving_workloads import ModelCost
from kvserve.scheduler.step_plan import StepPlan

ROOFLINE_HEADERS = ["workload", "steps", "count", "s", "share of run", "tokens", "floor s", "s / floor"]


@dataclass(frozen=True, slots=True)
class StepTime:
    """One step: its seconds, the tokens it computed, and what its floor rests on."""

    seconds: float
    num_tokens: int
    has_prefill: bool
    attention_pairs: float  # causal (query, key) pairs of its prefill rows
    context_tokens: int  # every row's context after the step: the K/V a decode row reads

    @classmethod
    def of(cls, plan: StepPlan, seconds: float) -> StepTime:
        pairs = 0.0
        for new, cached in zip(plan.num_scheduled_tokens, plan.num_computed_tokens):
            if new > 1:
                pairs += new * cached + new * (new + 1) / 2
        return cls(
            seconds=seconds,
            num_tokens=len(plan.token_ids),
            has_prefill=any(new > 1 for new in plan.num_scheduled_tokens),
            attention_pairs=pairs,
            context_tokens=sum(plan.num_computed_tokens) + len(plan.token_ids),
        )

    def floor_s(self, cost: ModelCost, matmul_flops_per_s: float, read_bytes_per_s: float) -> float:
        flops = self.num_tokens * cost.matmul_flops_per_token + self.attention_pairs * cost.attention_flops_per_pair
        read = cost.weight_bytes + self.context_tokens * cost.kv_bytes_per_token
        return max(flops / matmul_flops_per_s, read / read_bytes_per_s)


class StepTimes:
    """The steps an engine runs while ``recording()``: plain scheduling only."""

    def __init__(self) -> None:
        self.steps: list[StepTime] = []

    @contextmanager
    def recording(self, engine) -> Iterator[StepTimes]:  # noqa: ANN001 - an EngineCore
        """Time each ``engine.executor.execute`` call: the steps of plain scheduling.  (Overlapped
        steps are launched, and their results waited for in the next step's call: not recorded.)"""
        executor = engine.executor
        execute = executor.execute

        def timed(plan: StepPlan):  # noqa: ANN202
            start = time.perf_counter()
            result = execute(plan)
            self.steps.append(StepTime.of(plan, time.perf_counter() - start))
            return result

        executor.execute = timed
        try:
            yield self
        finally:
            del executor.execute


def roofline_rows(name: str, steps: list[StepTime], runs: int, run_s: float, cost: ModelCost,
                  matmul_flops_per_s: float | None, read_bytes_per_s: float | None) -> list[list[str]]:
    """Rows of ``ROOFLINE_HEADERS``: the ``steps`` of ``runs`` runs of ``run_s`` seconds each, by kind
    and all together, per run; floors only where both rates are known (a GPU)."""
    kinds = [("with prefill", [s for s in steps if s.has_prefill]), ("decode only", [s for s in steps if not s.has_prefill]),
             ("all steps", steps)]
    rows = []
    for kind, chosen in kinds:
        if not chosen:
            continue
        seconds = sum(s.seconds for s in chosen) / runs
        floor = None
        if matmul_flops_per_s and read_bytes_per_s:
            floor = sum(s.floor_s(cost, matmul_flops_per_s, read_bytes_per_s) for s in chosen) / runs
        rows.append([name, kind, round(len(chosen) / runs), f"{seconds:.2f}", f"{seconds / run_s:.2f}",
                     round(sum(s.num_tokens for s in chosen) / runs), f"{floor:.2f}" if floor else "-",
                     f"{seconds / floor:.2f}" if floor else "-"])
    return rows
