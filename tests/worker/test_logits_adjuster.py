"""Logits adjustments: OpenAI's penalties and biases, vLLM's repetition penalty, ``min_tokens``, and the counts
and prompt tokens kept on the device."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.step_plan import NewRequestData, StepPlan
from kvserve.worker.logits_adjuster import LogitsAdjuster
from kvserve.worker.sampler import Sampler

VOCAB = 12
CPU = torch.device("cpu")


def plan(
    step_id: int, new: Sequence[NewRequestData] = (), finished: Sequence[str] = (), preempted: Sequence[str] = ()
) -> StepPlan:
    """A plan that only starts and ends requests (the adjuster reads nothing else of it)."""
    return StepPlan(step_id, [], [], [], [], [], [], [], list(new), list(finished), list(preempted))


def start(
    adjuster: LogitsAdjuster, req_id: str, params: SamplingParams, outputs: Sequence[int] = (), stops: Sequence[int] = (),
    prompt: Sequence[int] = (),
) -> None:
    new = NewRequestData(req_id, params, len(prompt) or 3, tuple(outputs), tuple(stops), tuple(prompt))
    adjuster.apply_plan(plan(0, [new]))


def counts_of(adjuster: LogitsAdjuster, req_ids: list[str]) -> list[list[int]]:
    adjustments = adjuster.prepare(req_ids, [0] * len(req_ids))
    return adjustments.counts.tolist()


def expected_counts(token_ids: list[int]) -> list[int]:
    return torch.bincount(torch.tensor(token_ids, dtype=torch.int64), minlength=VOCAB).tolist()


def test_penalties_and_biases_follow_openais_definition() -> None:
    adjuster = LogitsAdjuster(VOCAB, CPU)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=1.25, logit_bias={3: 2.0, 11: -100.0})
    start(adjuster, "a", params, outputs=[4, 4, 9])
    start(adjuster, "plain", SamplingParams())
    logits = torch.randn(3, VOCAB)
    adjustments = adjuster.prepare(["plain", "a", "unknown"], [0, 3, 0])
    adjusted = adjustments.apply(logits.clone())
    expected = logits[1].clone()
    expected[4] -= 2 * 1.25 + 0.5
    expected[9] -= 1.25 + 0.5
    expected[3] += 2.0
    expected[11] -= 100.0
    torch.testing.assert_close(adjusted[1], expected)
    assert torch.equal(adjusted[[0, 2]], logits[[0, 2]])  # rows without adjustments are untouched


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output_tokens() -> None:
    """vLLM's order: the bias first, then the repetition penalty, then OpenAI's penalties."""
    adjuster = LogitsAdjuster(VOCAB, CPU)
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, logit_bias={5: 1.0})
    start(adjuster, "a", params, outputs=[4, 4], prompt=[1, 5, 1, 7])
    logits = torch.tensor([[0.5, 3.0, -2.0, 1.0, -4.0, -0.5, 2.0, 0.0, 1.5, -1.5, 2.5, -3.5]])
    adjusted = adjuster.prepare(["a"], [2]).apply(logits.clone())
    expected = logits[0].clone()
    expected[1] = 3.0 / 2  # in the prompt (twice: it counts once)
    expected[4] = -4.0 * 2 - 2 * 0.5  # generated twice
    expected[5] = (-0.5 + 1.0) / 2  # biased, then in the prompt
    expected[7] = 0.0  # 0 stays 0
    torch.testing.assert_close(adjusted[0], expected)
    # Each step's samples are penalized from the next step on.
    adjuster.record(adjuster.prepare(["a"], [2]), torch.tensor([9]))
    assert adjuster.prepare(["a"], [3]).apply(logits.clone())[0, 9].item() == -1.5 * 2 - 0.5


def test_a_reused_row_forgets_the_prompt_of_its_last_request() -> None:
    adjuster = LogitsAdjuster(VOCAB, CPU)
    repeated = SamplingParams(repetition_penalty=2.0)
    start(adjuster, "a", repeated, prompt=[3, 6])
    adjuster.apply_plan(plan(1, finished=["a"]))
    start(adjuster, "b", repeated, prompt=[8])
    logits = torch.ones(1, VOCAB)
    adjusted = adjuster.prepare(["b"], [0]).apply(logits.clone())
    assert adjusted[0].tolist() == [0.5 if token_id == 8 else 1.0 for token_id in range(VOCAB)]


@pytest.mark.parametrize("penalty", [1e-300, 1e-40, 1e300])
def test_extreme_repetition_penalties_keep_the_logits_finite(penalty: float) -> None:
    """A penalty near 0 divides logits past float32's range (or to 0 / 0), a huge one multiplies them past it:
    clamped, the sampler still draws a token (inf - inf would make its probabilities NaN)."""
    adjuster = LogitsAdjuster(VOCAB, CPU)
    params = SamplingParams(repetition_penalty=penalty, temperature=1.0, seed=3)
    start(adjuster, "a", params, prompt=list(range(VOCAB)))
    logits = torch.tensor([[30.0, 20.0, 0.0, -0.0, -20.0, -30.0, 5.0, 1.0, -1.0, 2.0, -2.0, 0.5]])
    adjustments = adjuster.prepare(["a"], [0])
    adjusted = adjustments.apply(logits.clone())
    assert torch.isfinite(adjusted).all()
    assert adjusted[0].argmax().item() == 0  # the largest logit (a huge penalty takes every positive one to 0)
    token_ids, _ = (sampled := Sampler(seed=0)(logits, [params], [0], adjustments)).unpack(sampled.pack())
    assert 0 <= token_ids[0] < VOCAB


def test_counts_follow_each_steps_samples_and_restart_from_the_tokens_sent() -> None:
    adjuster = LogitsAdjuster(VOCAB, CPU)
    penalised = SamplingParams(frequency_penalty=1.0)
    start(adjuster, "a", penalised)
    start(adjuster, "b", penalised, outputs=[7, 7])
    start(adjuster, "biased", SamplingParams(logit_bias={1: 1.0}))
    history = {"a": [], "b": [7, 7]}
    for step, (sample_a, sample_b) in enumerate([(2, 3), (2, 7), (5, 2)]):
        adjustments = adjuster.prepare(["b", "biased", "a"], [step] * 3)
        adjuster.record(adjustments, torch.tensor([sample_b, 0, sample_a]))
        history["a"].append(sample_a)
        history["b"].append(sample_b)
    assert counts_of(adjuster, ["a", "b"]) == [expected_counts(history["a"]), expected_counts(history["b"])]
    # Preempted, then resumed with its outputs so far: the same counts.
    adjuster.apply_plan(plan(1, preempted=["a"]))
    assert adjuster.num_requests == 2
    start(adjuster, "a", penalised, outputs=history["a"])
    assert counts_of(adjuster, ["a"]) == [expected_counts(history["a"])]


def test_rows_of_ended_requests_are_reused_and_the_table_grows_past_them() -> None:
    adjuster = LogitsAdjuster(VOCAB, CPU)
    penalised = SamplingParams(presence_penalty=1.0)
    for i in range(4):
        start(adjuster, f"r{i}", penalised, outputs=[i])
    adjuster.apply_plan(plan(1, finished=["r0", "r1"]))
    start(adjuster, "new", penalised)  # a reused row starts from zero
    for i in range(4, 9):  # more than the table held
        start(adjuster, f"r{i}", penalised, outputs=[i, i])
    assert adjuster.num_requests == 2 + 1 + 5
    assert counts_of(adjuster, ["new", "r2", "r3", "r8"]) == [
        [0] * VOCAB, expected_counts([2]), expected_counts([3]), expected_counts([8, 8])
    ]
    adjuster.apply_plan(plan(2, finished=[f"r{i}" for i in range(2, 9)] + ["new"]))
    assert adjuster.num_requests == 0 and adjuster.prepare(["r2"], [0]) is None


def test_min_tokens_holds_back_every_stop_token_until_reached() -> None:
    adjuster = LogitsAdjuster(VOCAB, CPU)
    start(adjuster, "a", SamplingParams(min_tokens=2), stops=[0, 5])
    logits = torch.zeros(1, VOCAB)
    for output_index in (0, 1):
        adjusted = adjuster.prepare(["a"], [output_index]).apply(logits.clone())
        assert torch.isinf(adjusted[0, [0, 5]]).all() and torch.isfinite(adjusted[0, 1:5]).all()
    assert adjuster.prepare(["a"], [2]) is None  # nothing left to adjust


def test_requests_without_adjustments_are_not_kept() -> None:
    adjuster = LogitsAdjuster(VOCAB, CPU)
    start(adjuster, "plain", SamplingParams(temperature=0.0))
    assert adjuster.num_requests == 0 and adjuster.prepare(["plain"], [0]) is None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sampler_samples_adjusted_logits_but_reports_raw_logprobs(temperature: float) -> None:
    adjuster = LogitsAdjuster(VOCAB, CPU)
    params = SamplingParams(temperature=temperature, logit_bias={6: 100.0}, logprobs=1, seed=1)
    start(adjuster, "a", params)
    logits = torch.randn(1, VOCAB)
    sampled = Sampler(seed=0)(logits, [params], [0], adjuster.prepare(["a"], [0]))
    token_ids, logprobs = sampled.unpack(sampled.pack())
    assert token_ids == [6]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert logprobs.token_logprobs == pytest.approx([raw[6].item()], abs=1e-6)
    assert logprobs.top_token_ids == [int(raw.argmax())]
