"""The sampler's min-p: the tokens it may sample, its place after top-k and top-p, and its cost when unused.

Min-p is checked against transformers' ``MinPLogitsWarper`` (and its warper chain for the order); the
other tests build logits whose threshold is known and draw many seeded tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.worker.sampler import Sampler, _filtered_probs

# min_p 0.19 of the best 0.5 is a threshold of 0.095: tokens 0, 1 and 2 stay, 3, 4 and 5 go.
PROBS = [0.5, 0.2, 0.1, 0.09, 0.06, 0.05]
MIN_P = 0.19
KEPT = {0, 1, 2}


def log_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def seeded_draws(row: torch.Tensor, params: SamplingParams, num_draws: int) -> list[int]:
    """``num_draws`` tokens for one row of logits, each row of the batch with its own seed."""
    batch = [dataclasses.replace(params, seed=seed) for seed in range(num_draws)]
    return Sampler(seed=0)(row.expand(num_draws, -1), batch, [0] * num_draws).token_ids.tolist()


def frequencies(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(token_ids), minlength=vocab_size).double() / len(token_ids)


def test_min_p_never_samples_a_token_below_its_threshold() -> None:
    token_ids = seeded_draws(log_probs(PROBS), SamplingParams(min_p=MIN_P), 5000)

    assert set(token_ids) == KEPT
    # The tokens kept keep their proportions: 0.5 : 0.2 : 0.1.
    expected = torch.tensor([0.625, 0.25, 0.125, 0.0, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(frequencies(token_ids, len(PROBS)), expected, atol=0.02, rtol=0)


def test_min_p_applies_after_temperature() -> None:
    # At temperature 2 the probabilities go as sqrt(p): 0.19 of sqrt(0.5) is 0.134, and sqrt(0.05) is 0.224.
    token_ids = seeded_draws(log_probs(PROBS), SamplingParams(temperature=2.0, min_p=MIN_P), 5000)

    assert set(token_ids) == set(range(len(PROBS)))
    # 0.9 of sqrt(0.5) is 0.636: only sqrt(0.5) itself stays.
    assert set(seeded_draws(log_probs(PROBS), SamplingParams(temperature=2.0, min_p=0.9), 500)) == {0}


def test_min_p_of_1_samples_only_the_most_likely_tokens() -> None:
    row = torch.tensor([2.0, 3.0, 3.0, 1.0, 2.9, -1.0])

    token_ids = seeded_draws(row, SamplingParams(temperature=1.5, min_p=1.0), 2000)

    assert set(token_ids) == {1, 2}  # the two tied best tokens, both


def test_min_p_0_samples_the_tokens_sampling_without_it_does() -> None:
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(3)) * 3
    params = [
        SamplingParams(temperature=0.8, seed=i) if i % 3 == 0
        else SamplingParams(top_k=40, top_p=0.9) if i % 3 == 1
        else SamplingParams(temperature=1.3)
        for i in range(64)
    ]
    zeros = [dataclasses.replace(p, min_p=0.0) for p in params]
    one_with_min_p = [dataclasses.replace(p, min_p=0.5) if i == 7 else p for i, p in enumerate(params)]

    plain = Sampler(seed=0)(logits, params, range(64)).token_ids
    with_zeros = Sampler(seed=0)(logits, zeros, range(64)).token_ids
    beside_min_p = Sampler(seed=0)(logits, one_with_min_p, range(64)).token_ids

    assert torch.equal(with_zeros, plain)
    others = [i for i in range(64) if i != 7]
    assert torch.equal(beside_min_p[others], plain[others])


def test_rows_without_min_p_keep_exactly_their_probabilities_beside_rows_with_it() -> None:
    scaled = torch.randn(6, 300, generator=torch.Generator().manual_seed(4)) * 2
    params = [SamplingParams(), SamplingParams(top_k=20), SamplingParams(top_p=0.8)] * 2
    mixed = params[:3] + [dataclasses.replace(p, min_p=0.2) for p in params[3:]]

    alone = _filtered_probs(scaled, params)
    beside = _filtered_probs(scaled, mixed)

    assert torch.equal(beside[:3], alone[:3])  # bit for bit
    assert bool((beside[3:] <= alone[3:]).all()) and bool((beside[3:] == 0).sum() > (alone[3:] == 0).sum())


def test_a_mixed_batch_filters_only_the_rows_with_min_p() -> None:
    num_draws = 3000
    row = log_probs(PROBS)
    kinds = [SamplingParams(min_p=MIN_P), SamplingParams(), SamplingParams(temperature=0.0, min_p=0.9)]
    params = [dataclasses.replace(kinds[i % 3], seed=i) for i in range(num_draws)]

    token_ids = Sampler(seed=0)(row.expand(num_draws, -1), params, [0] * num_draws).token_ids.tolist()

    assert set(token_ids[0::3]) == KEPT
    assert set(token_ids[1::3]) == set(range(len(PROBS)))  # 0.05 of 1,000 draws: the tail is sampled
    assert set(token_ids[2::3]) == {0}  # greedy


def test_min_p_comes_after_top_p_as_in_transformers_generate() -> None:
    # top_p 0.72 keeps 0.4, 0.3 and 0.2 (0.7 above the last); min_p 0.3 (a threshold of 0.12) then
    # keeps them.  Min-p first would drop 0.1 and renormalise: 0.2 would have 0.78 above it and go.
    row = log_probs([0.4, 0.3, 0.2, 0.1])

    token_ids = seeded_draws(row, SamplingParams(top_p=0.72, min_p=0.3), 5000)

    assert set(token_ids) == {0, 1, 2}
    expected = torch.tensor([4 / 9, 3 / 9, 2 / 9, 0.0], dtype=torch.float64)
    torch.testing.assert_close(frequencies(token_ids, 4), expected, atol=0.02, rtol=0)


def test_top_k_and_min_p_keep_the_tokens_both_keep() -> None:
    token_ids = seeded_draws(log_probs(PROBS), SamplingParams(top_k=2, min_p=MIN_P), 2000)

    assert set(token_ids) == {0, 1}


def test_a_batch_without_min_p_skips_its_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a batch without min-p must not compute its threshold")

    monkeypatch.setattr(torch.Tensor, "amax", forbidden)
    monkeypatch.setattr(torch.Tensor, "masked_fill", forbidden)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))

    # Greedy rows with min_p do not sample: the batch has nothing to filter.
    params = [SamplingParams(), SamplingParams(seed=1, min_p=0.0), SamplingParams(temperature=0.0, min_p=0.5)]
    out = Sampler(seed=0)(logits, params, [0, 0, 0])

    assert out.token_ids[2] == logits[2].argmax()


@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.05, 0.1, 0.3, 0.7, 1.0])
def test_min_p_keeps_the_tokens_transformers_min_p_warper_keeps(min_p: float) -> None:
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(6)) * 2.5
    scaled = logits - logits.max(dim=-1, keepdim=True).values  # as the sampler scales them

    ours = _filtered_probs(scaled, [SamplingParams(min_p=min_p)] * 8)
    theirs = torch.softmax(MinPLogitsWarper(min_p)(None, logits), dim=-1)

    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours / ours.sum(dim=-1, keepdim=True), theirs)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(0.7, 50, 0.9, 0.1), (1.3, 200, 0.95, 0.02), (1.0, 5, 1.0, 0.5), (0.5, None, 0.6, 0.05)],
)
def test_with_temperature_top_k_and_top_p_min_p_keeps_what_transformers_warpers_keep(
    temperature: float, top_k: int | None, top_p: float, min_p: float
) -> None:
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(7)) * 2.5
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    # transformers' generate() builds its warpers in this order.
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p),
                                   MinPLogitsWarper(min_p)])
    if top_k is not None:
        warpers.insert(1, TopKLogitsWarper(top_k))

    ours = _filtered_probs((logits - logits.max(dim=-1, keepdim=True).values) / temperature, [params] * 8)
    theirs = torch.softmax(warpers(None, logits), dim=-1)

    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours / ours.sum(dim=-1, keepdim=True), theirs)


def test_sampled_frequencies_follow_transformers_min_p_distribution() -> None:
    row = torch.randn(12, generator=torch.Generator().manual_seed(8)) * 1.5
    expected = torch.softmax(MinPLogitsWarper(0.15)(None, row[None] / 0.8), dim=-1)[0].double()

    token_ids = seeded_draws(row, SamplingParams(temperature=0.8, min_p=0.15), 20000)

    assert set(token_ids) == set(expected.nonzero().flatten().tolist())
    torch.testing.assert_close(frequencies(token_ids, 12), expected, atol=0.015, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_min_p_on_cuda_does_not_wait_for_the_device() -> None:
    logits = log_probs(PROBS).expand(256, -1).cuda()
    params = [SamplingParams(min_p=MIN_P, seed=i) if i % 2 else SamplingParams(top_k=4, min_p=MIN_P)
              for i in range(256)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        token_ids = Sampler(seed=0)(logits, params, [0] * 256).token_ids
    finally:
        torch.cuda.set_sync_debug_mode("default")

    assert set(token_ids.tolist()) == KEPT
