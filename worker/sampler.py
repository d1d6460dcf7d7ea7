"""Turn one step's logits into one sampled token per request.

Sampling uses the exponential race: with ``E_v ~ Exp(1)`` independent per
token, ``argmax_v p_v / E_v`` is distributed exactly as ``Categorical(p)``.  The
randomness is thus a tensor of noise drawn *before* looking at the logits,
which makes reproducible seeded sampling simple: a seeded request draws its
noise from a generator seeded by ``(seed, output_index)`` alone, so its tokens
do not depend on the batch it shares a step with, its row in that batch, or
whether it was preempted and recomputed.

Log-probabilities are computed only for the rows whose requests ask
(``SamplingParams.logprobs``), on the device, and travel back to the host with
the sampled tokens in one copy (``SamplerOutput.pack``): a step without them
pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

import numpy as np
import torch

from kvserve.kernels.host_to_device import list_to_device
from kvserve.scheduler.logprobs import StepLogprobs
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.worker.logits_adjuster import StepAdjustments

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SampledLogprobs:
    """Log-probabilities of the rows whose requests asked, on the device.

    ``rows`` (host) are those rows, increasing; ``num_top`` (host) how many
    alternatives each asked for.  ``token_logprobs`` is float32 ``[len(rows)]``:
    each sampled token's log-probability under the model's raw distribution
    (``log_softmax`` of the unmodified logits, before temperature, top-k,
    top-p or min-p).  ``top_logprobs`` (float32) and ``top_token_ids``
    (int64) are ``[len(rows), max(num_top)]``, most likely first; a row uses
    its first ``num_top`` columns.
    """

    rows: list[int]
    num_top: list[int]
    token_logprobs: torch.Tensor
    top_logprobs: torch.Tensor
    top_token_ids: torch.Tensor


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """The sampled token of each request in a step, and the logprobs of those that asked.

    ``token_ids`` is int64 ``[num_reqs]``; ``logprobs`` is ``None`` when no
    request of the step asked for them.
    """

    token_ids: torch.Tensor
    logprobs: SampledLogprobs | None = None

    def pack(self) -> torch.Tensor:
        """Everything the host needs as one tensor on the device, so that one copy brings it back.

        Without logprobs, ``token_ids`` itself.  With them, float64: the token
        ids, then the rows' token logprobs, their top logprobs and their top
        token ids, flattened (float64 holds int32 ids and float32 values exactly).
        """
        logprobs = self.logprobs
        if logprobs is None:
            return self.token_ids
        return torch.cat([
            self.token_ids.double(),
            logprobs.token_logprobs.double(),
            logprobs.top_logprobs.double().flatten(),
            logprobs.top_token_ids.double().flatten(),
        ])

    def unpack(self, packed: torch.Tensor) -> tuple[list[int], StepLogprobs | None]:
        """The sampled token ids and the step's logprobs from ``pack()``'s result, on the host."""
        logprobs = self.logprobs
        if logprobs is None:
            return packed.tolist(), None
        values = packed.numpy()
        num_reqs = self.token_ids.shape[0]
        num_rows, width = logprobs.top_logprobs.shape
        token_ids, token_logprobs, top_logprobs, top_token_ids = np.split(
            values, np.cumsum([num_reqs, num_rows, num_rows * width])
        )
        keep = np.arange(width)[None, :] < np.asarray(logprobs.num_top, dtype=np.int64)[:, None]
        return token_ids.astype(np.int64).tolist(), StepLogprobs(
            rows=list(logprobs.rows),
            token_logprobs=token_logprobs.tolist(),
            num_top=list(logprobs.num_top),
            top_token_ids=top_token_ids.reshape(num_rows, width)[keep].astype(np.int64).tolist(),
            top_logprobs=top_logprobs.reshape(num_rows, width)[keep].tolist(),
        )


class Sampler:
    """Samples one token per row of a ``[num_reqs, vocab]`` logits tensor.

    Greedy requests (temperature 0) take the argmax.  The others divide their
    logits by the temperature, keep the ``top_k`` best tokens, then keep the
    smallest set of most probable tokens whose probability reaches ``top_p``
    (always at least the best one), then drop the tokens whose probability is
    below ``min_p`` times the best one's, and sample from what is left.

    The order is transformers' ``generate`` (its warpers run temperature,
    top-k, top-p, min-p) and vLLM's V0 sampler's (top-k and top-p, then
    min-p).  Min-p compares each token to the best one, a ratio that top-k's
    and top-p's renormalisation leaves as it was, so the order only matters
    with top-p: top-p measures the mass before min-p removes anything.
    Greedy rows ignore all three filters.

    Requests with a ``seed`` draw their randomness from ``(seed,
    output_index)`` only.  Requests without one share a generator owned by the
    sampler, seeded with ``seed`` (or nondeterministically when ``None``).
    """

    def __init__(self, seed: int | None = None) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an integer or None, got {seed!r}")
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
        adjustments: StepAdjustments | None = None,
    ) -> SamplerOutput:
        """Sample row ``i`` of ``logits`` with ``params[i]``.

        ``output_indices[i]`` is the position, within request ``i``'s output,
        of the token being sampled (0 for its first generated token).  Logits
        of any float dtype are accepted; the work is done in float32 on their
        device.  ``adjustments`` (penalties, biases, ``min_tokens``) change the
        logits first, greedy rows' too; logprobs stay those of the raw logits.
        """
        _check_inputs(logits, params, output_indices)
        raw_logits = logits.float()
        # NOTE: a copy: the logprobs are the raw logits' (and the caller's tensor stays as it was).
        logits = raw_logits if adjustments is None else adjustments.apply(raw_logits.clone())
        # NOTE: max() returns the first maximal index like argmax(), at a third of its cost on CPU.
        max_logits, greedy_ids = logits.max(dim=-1)
        if all(p.is_greedy for p in params):
            token_ids = greedy_ids
        else:
            token_ids = self._sample(logits, params, output_indices, max_logits, greedy_ids)
        return SamplerOutput(token_ids=token_ids, logprobs=_logprobs(raw_logits, params, token_ids))

    def _sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
        max_logits: torch.Tensor,
        greedy_ids: torch.Tensor,
    ) -> torch.Tensor:
        device = logits.device
        # Greedy rows are sampled at temperature 1 and then replaced by their argmax.
        # NOTE: list_to_device: torch.tensor(..., device="cuda") copies from pageable
        # memory, which makes the host wait for the step's queued work.
        temperatures = list_to_device([p.temperature or 1.0 for p in params], torch.float32, device)
        # NOTE: each row's best logit is 0 before the division, so that a tiny
        # temperature sends the others to -inf, never the best to inf: logits
        # of 20 / 1e-39 overflowed, softmax gave nan and every token was 0.
        # A temperature below float32's smallest normal number (or rounding
        # to 0) counts as that number: sampling is then greedy among ties.
        temperatures.clamp_min_(torch.finfo(torch.float32).tiny)
        probs = _filtered_probs((logits - max_logits[:, None]) / temperatures[:, None], params)
        noise = self._exponential_noise(probs.shape, params, output_indices, device)
        sampled_ids = (probs / noise).argmax(dim=-1)
        is_greedy = list_to_device([p.is_greedy for p in params], torch.bool, device)
        return torch.where(is_greedy, greedy_ids, sampled_ids)

    def _exponential_noise(
        self,
        shape: torch.Size,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
        device: torch.device,
    ) -> torch.Tensor:
        noise = torch.empty(shape, device=device).exponential_(generator=self._generator(device))
        for row, (request_params, output_index) in enumerate(zip(params, output_indices)):
            if request_params.seed is not None:
                generator = torch.Generator(device=device)
                generator.manual_seed(_mix_seed(request_params.seed, output_index))
                # NOTE: drawn into a fresh 1-D tensor, so the values cannot depend
                # on the row's place in the batch.
                noise[row] = torch.empty(shape[-1], device=device).exponential_(generator=generator)
        # exponential_ may return exactly 0; a zero-probability token must never win.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed & _MASK64)
            self._generators[device] = generator
        return generator


def _logprobs(
    logits: torch.Tensor, params: Sequence[SamplingParams], token_ids: torch.Tensor
) -> SampledLogprobs | None:
    """The logprobs of the rows whose requests asked (``None`` when none did), in float32 on the device."""
    rows = [row for row, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    num_top = [params[row].logprobs for row in rows]
    if len(rows) < len(params):
        index = list_to_device(rows, torch.int64, logits.device)
        logits, token_ids = logits[index], token_ids[index]
    logprobs = torch.log_softmax(logits, dim=-1)
    token_logprobs = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
    # NOTE: topk's k may not exceed the vocabulary (a tiny test model has fewer than 20 tokens).
    width = min(max(num_top), logprobs.shape[-1])
    top_logprobs, top_token_ids = logprobs.topk(width, dim=-1)
    return SampledLogprobs(rows, [min(k, width) for k in num_top], token_logprobs, top_logprobs, top_token_ids)


def _filtered_probs(scaled_logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Each row's probabilities after its top-k, top-p and min-p filters.

    In a batch with min-p, the rows are not renormalised after it: the
    exponential race compares the ratios within a row only, and a row without
    min-p keeps exactly the values it has in a batch without any.
    """
    probs = _top_k_top_p_probs(scaled_logits, params)
    # Greedy rows take their argmax whatever they draw: their min-p would be work for nothing.
    min_ps = [0.0 if p.is_greedy else p.min_p for p in params]
    if all(min_p == 0.0 for min_p in min_ps):
        return probs
    # NOTE: the threshold is at most the best probability (min_p <= 1 in float32 too): the best token stays.
    min_p = list_to_device(min_ps, torch.float32, probs.device)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


def _top_k_top_p_probs(scaled_logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Softmax of each row after its top-k and top-p filters (one sort for the batch)."""
    num_reqs, vocab_size = scaled_logits.shape
    top_ks = [min(p.top_k, vocab_size) if p.top_k is not None else vocab_size for p in params]
    if all(k == vocab_size for k in top_ks) and all(p.top_p == 1.0 for p in params):
        return torch.softmax(scaled_logits, dim=-1)

    device = scaled_logits.device
    sorted_logits, sorted_ids = scaled_logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab_size, device=device)
    top_k = list_to_device(top_ks, torch.int64, device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))

    # NOTE: rows without top-p get an infinite threshold: rounding can bring the
    # cumulative mass to 1.0 before the last token, which would drop the tail.
    top_p = list_to_device([p.top_p if p.top_p < 1.0 else float("inf") for p in params], torch.float32, device)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # The mass of the tokens ranked above each token; 0 for the best one, which is always kept
    # (a top_p that rounds to 0 in float32, 1e-46, would otherwise drop it too).
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    dropped = (mass_above >= top_p[:, None]) & (ranks[None, :] > 0)
    sorted_logits = sorted_logits.masked_fill(dropped, float("-inf"))

    filtered_logits = torch.full_like(scaled_logits, float("-inf")).scatter_(-1, sorted_ids, sorted_logits)
    return torch.softmax(filtered_logits, dim=-1)


def _mix_seed(seed: int, output_index: int) -> int:
    """A 64-bit generator seed that depends only on ``(seed, output_index)``."""
    return _splitmix64(_splitmix64(int(seed) & _MASK64) ^ int(output_index))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _check_inputs(
    logits: torch.Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int]
) -> None:
    if logits.ndim != 2:
        raise ValueError(f"logits must be 2-D [num_reqs, vocab], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
    num_reqs = logits.shape[0]
    if len(params) != num_reqs:
        raise ValueError(f"params must have one entry per logits row ({num_reqs}), got {len(params)}")
    if len(output_indices) != num_reqs:
        raise ValueError(
            f"output_indices must have one entry per logits row ({num_reqs}), got {len(output_indices)}"
        )
    for output_index in output_indices:
        # NOTE: the exact-type test first: isinstance against the Integral ABC is slow.
        is_int = type(output_index) is int or (
            isinstance(output_index, Integral) and not isinstance(output_index, bool)
        )
        if not is_int or output_index < 0:
            raise ValueError(f"output_indices must be non-negative integers, got {output_index!r}")
