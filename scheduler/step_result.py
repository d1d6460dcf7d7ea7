"""What the workers return for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.scheduler.logprobs import StepLogprobs, StepPromptLogprobs


@dataclass(frozen=True, slots=True)
class StepResult:
    """The tokens sampled for one ``StepPlan``, one per ``plan.sample`` row, in plan order.

    ``logprobs`` covers the sampled rows whose requests asked for them
    (``SamplingParams.logprobs``); ``None`` when none did.  ``prompt_logprobs``
    covers the plan's ``prompt_logprobs_rows``; ``None`` when it has none.
    """

    step_id: int
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: StepLogprobs | None = None
    prompt_logprobs: StepPromptLogprobs | None = None
