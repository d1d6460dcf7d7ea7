"""The sampler: greedy, temperature, top-k, top-p, and batch-independent seeded draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.worker.sampler import Sampler, SamplerOutput

GREEDY = SamplingParams(temperature=0.0)
RANDOM = SamplingParams(temperature=1.0)
PROBS = [0.4, 0.25, 0.2, 0.1, 0.05]
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


def log_probs(probs: list[float], device: str = "cpu") -> torch.Tensor:
    return torch.tensor(probs, device=device).log()


def frequencies(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(token_ids.cpu(), minlength=vocab_size).double() / token_ids.numel()


def assert_frequencies(token_ids: torch.Tensor, expected: list[float] | torch.Tensor, atol: float) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(frequencies(token_ids, len(expected)), expected, atol=atol, rtol=0)


def sample_many(
    sampler: Sampler, row: torch.Tensor, params: SamplingParams, num_draws: int
) -> torch.Tensor:
    """Draw ``num_draws`` tokens for one row of logits, as one batch."""
    out = sampler(row.expand(num_draws, -1), [params] * num_draws, [0] * num_draws)
    return out.token_ids


def test_greedy_batch_takes_argmax() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler(seed=0)(logits, [GREEDY] * 8, range(8))
    assert isinstance(out, SamplerOutput)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_greedy_ties_go_to_the_first_best_token_as_with_argmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [0.0, 2.0, -1.0, 2.0]])
    out = Sampler(seed=0)(logits, [GREEDY] * 3, [0, 0, 0])
    assert out.token_ids.tolist() == [1, 0, 1]
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_all_greedy_batch_neither_sorts_nor_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the all-greedy fast path must not sort or draw noise")

    monkeypatch.setattr(torch.Tensor, "sort", forbidden)
    monkeypatch.setattr(torch.Tensor, "exponential_", forbidden)
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, -1.0, 0.5]])
    out = Sampler()(logits, [GREEDY, SamplingParams(temperature=0.0, top_k=2, seed=3)], [0, 4])
    assert out.token_ids.tolist() == [1, 0]


def test_greedy_rows_of_a_mixed_batch_take_argmax() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    params = [GREEDY, RANDOM, GREEDY, SamplingParams(top_k=5, seed=9), GREEDY, RANDOM]
    out = Sampler(seed=0)(logits, params, [0] * 6)
    greedy_rows = [0, 2, 4]
    assert torch.equal(out.token_ids[greedy_rows], logits[greedy_rows].argmax(dim=-1))


def test_logprobs_are_the_raw_log_softmax_at_the_sampled_ids() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2)) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.5, logprobs=0),
        SamplingParams(temperature=2.0, top_k=3, logprobs=0),
        SamplingParams(top_p=0.5, seed=1, logprobs=0),
    ]
    out = Sampler(seed=0)(logits, params, [0, 1, 2, 3])
    expected = torch.log_softmax(logits, dim=-1).gather(-1, out.token_ids[:, None]).squeeze(-1)
    assert out.logprobs.rows == [0, 1, 2, 3]
    assert out.logprobs.token_logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs.token_logprobs, expected)


def test_a_greedy_tokens_logprob_is_the_largest_of_its_row() -> None:
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(5)) * 3
    out = Sampler(seed=0)(logits, [SamplingParams(temperature=0.0, logprobs=1)] * 5, [0] * 5)
    expected = torch.log_softmax(logits, dim=-1).max(dim=-1).values
    assert bool((out.logprobs.token_logprobs < 0).all())
    torch.testing.assert_close(out.logprobs.token_logprobs, expected)
    torch.testing.assert_close(out.logprobs.top_logprobs[:, 0], expected)
    assert torch.equal(out.logprobs.top_token_ids[:, 0], out.token_ids)


def test_top_logprobs_are_the_k_most_likely_tokens_of_each_row_that_asked() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(7)) * 2
    params = [GREEDY, SamplingParams(logprobs=3, seed=1), RANDOM, SamplingParams(temperature=0.0, logprobs=5)]
    out = Sampler(seed=0)(logits, params, [0] * 4)
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs.rows == [1, 3] and out.logprobs.num_top == [3, 5]
    top = reference.topk(5, dim=-1)
    torch.testing.assert_close(out.logprobs.top_logprobs, top.values[[1, 3]])
    assert torch.equal(out.logprobs.top_token_ids, top.indices[[1, 3]])
    token_ids, step = out.unpack(out.pack())
    assert token_ids == out.token_ids.tolist()
    assert step.rows == [1, 3] and step.num_top == [3, 5]
    assert step.top_token_ids == top.indices[1, :3].tolist() + top.indices[3].tolist()
    assert step.top_logprobs == pytest.approx(top.values[1, :3].tolist() + top.values[3].tolist())
    assert step.token_logprobs == pytest.approx(reference[[1, 3], token_ids[1::2]].tolist())


def test_a_step_without_logprob_requests_computes_none() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(8))
    out = Sampler(seed=0)(logits, [GREEDY, RANDOM, SamplingParams(top_k=4)], [0] * 3)
    assert out.logprobs is None
    assert out.pack() is out.token_ids
    assert out.unpack(out.pack()) == (out.token_ids.tolist(), None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_with_logprobs_on_cuda_waits_for_the_device_only_in_the_result() -> None:
    """Issue 32: the copy of the samples (and logprobs) is the step's one sync; the values are the CPU's."""
    from kvserve.worker.worker import LaunchedStep

    logits = torch.randn(8, 3000, generator=torch.Generator().manual_seed(11)) * 3
    params = [
        GREEDY, SamplingParams(temperature=0.0, logprobs=4), RANDOM, SamplingParams(top_k=20, seed=3, logprobs=0),
        SamplingParams(top_p=0.8, logprobs=20), GREEDY, SamplingParams(temperature=0.0, logprobs=1), RANDOM,
    ]
    cuda_logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = LaunchedStep.copying(7, Sampler(seed=0)(cuda_logits, params, [0] * 8))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    result = launched.result()
    assert result.logprobs.rows == [1, 3, 4, 6] and result.logprobs.num_top == [4, 0, 20, 1]
    reference = torch.log_softmax(logits, dim=-1)
    assert [result.sampled_token_ids[r] for r in (0, 1, 5, 6)] == reference[[0, 1, 5, 6]].argmax(-1).tolist()
    expected = reference[result.logprobs.rows, [result.sampled_token_ids[r] for r in result.logprobs.rows]]
    assert result.logprobs.token_logprobs == pytest.approx(expected.tolist(), abs=1e-4)
    top_ids, top_logprobs = result.logprobs.top_token_ids[4:24], result.logprobs.top_logprobs[4:24]
    assert top_logprobs == pytest.approx(reference[4].topk(20).values.tolist(), abs=1e-4)
    assert reference[4, top_ids].tolist() == pytest.approx(top_logprobs, abs=1e-4)


def test_top_logprobs_past_the_vocabulary_are_cut_to_it() -> None:
    logits = torch.randn(1, 6, generator=torch.Generator().manual_seed(9))
    out = Sampler(seed=0)(logits, [SamplingParams(temperature=0.0, logprobs=20)], [0])
    assert out.logprobs.num_top == [6]
    assert sorted(out.logprobs.top_token_ids[0].tolist()) == list(range(6))


def test_output_indices_of_any_integer_type_are_accepted() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(6))
    out = Sampler(seed=0)(logits, [GREEDY] * 2, [np.int64(3), torch.tensor(2).item()])
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_half_precision_logits_are_sampled_in_float32() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0, logprobs=0), SamplingParams(logprobs=0),
              SamplingParams(top_k=4, logprobs=0)]
    out = Sampler(seed=0)(logits, params, [0, 0, 0])
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs.token_logprobs.dtype == torch.float32
    assert out.token_ids[0] == logits[0].float().argmax()
    expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, out.token_ids[:, None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs.token_logprobs, expected)


def test_top_k_of_one_equals_greedy() -> None:
    logits = torch.randn(16, 200, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i if i % 2 else None) for i in range(16)]
    out = Sampler(seed=0)(logits, params, range(16))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_samples_only_the_k_best_tokens(device: str) -> None:
    row = torch.randn(100, generator=torch.Generator().manual_seed(5)).to(device)
    token_ids = sample_many(Sampler(seed=0), row, SamplingParams(temperature=5.0, top_k=3), 5000)
    assert set(token_ids.tolist()) == set(row.topk(3).indices.tolist())


def test_top_p_samples_only_the_nucleus() -> None:
    row = log_probs([0.3, 0.05, 0.5, 0.15])
    # Smallest set reaching 0.75: tokens 2 (0.5) and 0 (0.3).
    token_ids = sample_many(Sampler(seed=0), row, SamplingParams(top_p=0.75), 10000)
    freq = frequencies(token_ids, 4)
    assert freq[1] == 0 and freq[3] == 0
    assert_frequencies(token_ids, [0.375, 0.0, 0.625, 0.0], atol=0.02)


def test_tiny_top_p_keeps_the_best_token() -> None:
    row = log_probs([0.3, 0.05, 0.5, 0.15])
    token_ids = sample_many(Sampler(seed=0), row, SamplingParams(top_p=0.01), 1000)
    assert set(token_ids.tolist()) == {2}


@pytest.mark.parametrize("top_p", [1e-40, 1e-46, 5e-324])
def test_a_top_p_below_float32s_range_keeps_the_best_token(top_p: float) -> None:
    # 1e-46 rounds to 0 in float32: every token was dropped, softmax gave nan and token 0 won.
    row = log_probs([0.3, 0.05, 0.5, 0.15])
    token_ids = sample_many(Sampler(seed=0), row, SamplingParams(top_p=top_p), 100)
    assert set(token_ids.tolist()) == {2}


@pytest.mark.parametrize("temperature", [1e-6, 1e-37, 1e-39, 1e-46, 1e-300, 5e-324])
def test_a_tiny_temperature_samples_the_best_token(temperature: float) -> None:
    # Logits of ~10 divided by 1e-39 overflowed to inf (1e-46: divided by 0),
    # softmax gave nan and every sampled token was 0.
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0)) * 10
    logits[:, 0] = -30.0  # token 0 is never the best
    params = [SamplingParams(temperature=temperature), SamplingParams(temperature=temperature, seed=7)] * 4

    out = Sampler(seed=0)(logits, params, [0] * 8)

    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()


def test_top_p_applies_to_the_top_k_distribution() -> None:
    # top_k=3 renormalises to [0.44, 0.33, 0.22]; then 0.75 is reached by the
    # first two.  (On the unfiltered distribution token 2 would be kept.)
    row = log_probs([0.4, 0.3, 0.2, 0.1])
    token_ids = sample_many(Sampler(seed=0), row, SamplingParams(top_k=3, top_p=0.75), 5000)
    assert set(token_ids.tolist()) == {0, 1}


def test_zero_probability_tokens_are_never_sampled() -> None:
    row = torch.tensor([0.0, float("-inf"), 0.0, float("-inf"), -50.0])
    token_ids = sample_many(Sampler(seed=0), row, RANDOM, 20000)
    assert set(token_ids.tolist()) <= {0, 2, 4}


@pytest.mark.parametrize("device", DEVICES)
def test_empirical_frequencies_match_the_probabilities(device: str) -> None:
    token_ids = sample_many(Sampler(seed=0), log_probs(PROBS, device), RANDOM, 20000)
    # Standard deviation of each frequency is at most sqrt(0.25 / 20000) = 0.0035.
    assert_frequencies(token_ids, PROBS, atol=0.015)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_reshapes_the_distribution(temperature: float) -> None:
    token_ids = sample_many(Sampler(seed=0), log_probs(PROBS), SamplingParams(temperature=temperature), 20000)
    # Dividing log-probabilities by T gives probabilities proportional to p ** (1 / T).
    powered = torch.tensor([p ** (1 / temperature) for p in PROBS], dtype=torch.float64)
    expected = powered / powered.sum()
    assert_frequencies(token_ids, expected, atol=0.015)
    freq = frequencies(token_ids, 5)
    if temperature < 1:
        assert freq[0] > PROBS[0] + 0.1
    else:
        assert freq[4] > PROBS[4] + 0.03


def test_seeded_requests_follow_the_distribution() -> None:
    num_draws = 10000
    logits = log_probs(PROBS).expand(num_draws, -1)
    params = [SamplingParams(seed=seed) for seed in range(num_draws)]
    token_ids = Sampler()(logits, params, [0] * num_draws).token_ids
    assert_frequencies(token_ids, PROBS, atol=0.02)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_request_ignores_the_rest_of_the_batch(device: str) -> None:
    vocab_size = 1000
    generator = torch.Generator().manual_seed(6)
    target_logits = torch.randn(vocab_size, generator=generator).to(device)
    target = SamplingParams(temperature=0.8, top_p=0.95, top_k=200, seed=1234)
    others = [
        RANDOM,
        GREEDY,
        SamplingParams(seed=1),
        SamplingParams(temperature=0.3, top_k=5, seed=1234 + 1),
        SamplingParams(top_p=0.5),
        SamplingParams(seed=1234),  # same seed, different logits
    ]

    def sample_in_batch(output_index: int, num_others: int, position: int, sampler_seed: int | None) -> int:
        other_logits = torch.randn(num_others, vocab_size, generator=generator).to(device)
        logits = torch.cat([other_logits[:position], target_logits[None], other_logits[position:]])
        params = [others[i % len(others)] for i in range(num_others)]
        params.insert(position, target)
        indices = [(7 * i) % 11 for i in range(num_others)]
        indices.insert(position, output_index)
        return int(Sampler(seed=sampler_seed)(logits, params, indices).token_ids[position])

    for output_index in range(10):
        alone = sample_in_batch(output_index, num_others=0, position=0, sampler_seed=0)
        assert sample_in_batch(output_index, num_others=3, position=0, sampler_seed=1) == alone
        assert sample_in_batch(output_index, num_others=7, position=5, sampler_seed=None) == alone
        assert sample_in_batch(output_index, num_others=12, position=12, sampler_seed=2) == alone


def test_output_index_changes_a_seeded_draw() -> None:
    num_steps = 20
    flat = torch.zeros(num_steps, 1000)
    out = Sampler()(flat, [SamplingParams(seed=42)] * num_steps, range(num_steps))
    assert len(set(out.token_ids.tolist())) >= num_steps - 2
    # The same (seed, output_index) twice in one batch gives the same token.
    again = Sampler()(flat[:2], [SamplingParams(seed=42)] * 2, [5, 5])
    assert again.token_ids.tolist() == [out.token_ids[5].item()] * 2


def test_different_seeds_give_different_draws() -> None:
    flat = torch.zeros(20, 1000)
    out = Sampler()(flat, [SamplingParams(seed=seed) for seed in range(20)], [0] * 20)
    assert len(set(out.token_ids.tolist())) >= 18


def test_unseeded_rows_are_reproducible_from_the_sampler_seed() -> None:
    flat = torch.zeros(32, 1000)
    params = [RANDOM] * 32

    def draws(sampler_seed: int) -> list[int]:
        sampler = Sampler(seed=sampler_seed)
        return [t for _ in range(3) for t in sampler(flat, params, [0] * 32).token_ids.tolist()]

    assert draws(5) == draws(5)
    assert draws(5) != draws(6)
    first_step = draws(5)[:32]
    assert first_step != draws(5)[32:64]  # the generator advances between steps


def test_empty_batch() -> None:
    out = Sampler()(torch.empty(0, 10), [], [])
    assert out.token_ids.shape == (0,) and out.logprobs is None


@pytest.mark.parametrize(
    ("logits", "num_params", "output_indices", "message"),
    [
        (torch.zeros(10), 1, [0], "logits must be 2-D"),
        (torch.zeros(2, 10, dtype=torch.int64), 2, [0, 0], "logits must be a float tensor"),
        (torch.zeros(2, 10), 1, [0, 0], "params must have one entry per logits row"),
        (torch.zeros(2, 10), 2, [0], "output_indices must have one entry per logits row"),
        (torch.zeros(2, 10), 2, [0, -1], "output_indices must be non-negative integers"),
        (torch.zeros(2, 10), 2, [0, 1.0], "output_indices must be non-negative integers"),
        (torch.zeros(2, 10), 2, [0, True], "output_indices must be non-negative integers"),
        (torch.zeros(2, 10), 2, [np.int64(-2), 0], "output_indices must be non-negative integers"),
    ],
)
def test_rejects_bad_inputs(
    logits: torch.Tensor, num_params: int, output_indices: list, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Sampler()(logits, [RANDOM] * num_params, output_indices)


def test_rejects_a_non_integer_sampler_seed() -> None:
    with pytest.raises(ValueError, match="seed must be an integer or None"):
        Sampler(seed=math.pi)  # type: ignore[arg-type]
