"""What the workers return for one step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StepResult:
    """The tokens sampled for one ``StepPlan``, one per ``plan.sample`` row, in plan order.

    ``logprobs[i]`` is the log-probability of ``sampled_token_ids[i]`` under the
    model's unmodified distribution.
    """

    step_id: int
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
