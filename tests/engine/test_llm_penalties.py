"""Presence, frequency and repetition penalties, logit biases and ``min_tokens`` give transformers' greedy tokens.

The reference is transformers' own ``generate()`` in float32: ``sequence_bias`` for
the biases, ``repetition_penalty`` for vLLM's (the same, prompt included),
``min_new_tokens`` for ``min_tokens``, and for OpenAI's penalties a logits
processor that applies their definition to the tokens generated so far.  The
tiny model's logits spread over about +-6, so a bias of 10 makes a token win until
the penalties push it back: the penalties then decide every other token.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from kvserve import LLM, SamplingParams
from kvserve.worker.tiny_model import create_tiny_model
from tests.engine.hf_reference import load_hf_model
from tests.engine.test_llm_async_scheduling import assert_same, generate_both
from tests.engine.test_llm_parity import random_prompts

FAVOURED = 42  # the token every penalised request is biased towards


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return create_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=3)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_hf_model(model_dir)


class OpenAIPenalties(LogitsProcessor):
    """``frequency * count + presence * (count > 0)`` off each logit, counting the generated tokens only."""

    def __init__(self, num_prompt_tokens: int, presence: float, frequency: float) -> None:
        self.num_prompt_tokens, self.presence, self.frequency = num_prompt_tokens, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.num_prompt_tokens :]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - (counts * self.frequency + (counts > 0) * self.presence)


def hf_adjusted_greedy(model, prompt: list[int], params: SamplingParams, eos_token_ids: list[int] | None = None):
    """transformers' greedy continuation of ``prompt`` under ``params``' adjustments (ending at and
    including one of ``eos_token_ids`` when given, else ``params.max_tokens`` long)."""
    processors = LogitsProcessorList()
    if params.presence_penalty or params.frequency_penalty:
        processors.append(OpenAIPenalties(len(prompt), params.presence_penalty, params.frequency_penalty))
    config = model.generation_config
    saved = config.eos_token_id
    config.eos_token_id = eos_token_ids
    try:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=params.max_tokens, do_sample=False, pad_token_id=0,
                sequence_bias={(token_id,): bias for token_id, bias in params.logit_bias} or None,
                min_new_tokens=params.min_tokens or None, logits_processor=processors,
                repetition_penalty=params.repetition_penalty if params.penalizes_prompt else None,
            )
    finally:
        config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


PENALISED = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logit_bias={FAVOURED: 10.0}, frequency_penalty=2.0),
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logit_bias={FAVOURED: 7.0}, presence_penalty=2.0),
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logit_bias={FAVOURED: 10.0, 43: 9.0},
                   frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logit_bias={FAVOURED: 10.0, 7: -100.0}),
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),  # no adjustment, in the same steps
]
# vLLM's repetition penalty, alone and after a bias, before OpenAI's penalties (vLLM's order, and transformers').
REPEATED = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.8),
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=0.6),  # rewards repeats
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.4,
                   logit_bias={FAVOURED: 10.0}, frequency_penalty=0.5, presence_penalty=0.5),
]


def test_penalties_and_biases_give_transformers_tokens(model_dir, hf_model) -> None:
    prompts = random_prompts(len(PENALISED), seed=11, lo=4, hi=30)
    biases_only = [dataclasses.replace(p, presence_penalty=0.0, frequency_penalty=0.0) for p in PENALISED]
    with LLM(model_dir, num_blocks=128) as llm:
        outputs = llm.generate(prompts, PENALISED, progress=False)
        unpenalised = llm.generate(prompts, biases_only, progress=False)
    for prompt, params, output in zip(prompts, PENALISED, outputs):
        assert output.token_ids == hf_adjusted_greedy(hf_model, prompt, params)
    assert outputs[3].token_ids == [FAVOURED] * 24  # a bias of 10 wins every step
    # Each penalty lets other tokens in where the bias alone repeated its token.
    for output, biased in zip(outputs[:3], unpenalised[:3]):
        assert 0 < output.token_ids.count(FAVOURED) < biased.token_ids.count(FAVOURED) - 4


def test_repetition_penalty_counts_the_prompt_cached_prefix_included_like_transformers(model_dir, hf_model) -> None:
    """The repetition penalty counts the prompt's tokens too: the worker learns them from the plan, those it
    finds in the prefix cache (and never computes) included."""
    shared = random_prompts(1, seed=14, lo=24, hi=25)[0]
    prompts = random_prompts(2 * len(REPEATED), seed=15, lo=3, hi=12, shared=shared)
    params = [REPEATED[i % len(REPEATED)] for i in range(len(prompts))]
    with LLM(model_dir, block_size=8, num_blocks=128) as llm:
        outputs = llm.generate(prompts, params, progress=False)
        plain = llm.generate(prompts, [dataclasses.replace(p, repetition_penalty=1.0) for p in params],
                             progress=False)
    assert all(output.num_cached_tokens >= 16 for output in outputs[1:])
    for prompt, request_params, output in zip(prompts, params, outputs):
        assert output.token_ids == hf_adjusted_greedy(hf_model, prompt, request_params)
    assert all(output.token_ids != unpenalised.token_ids for output, unpenalised in zip(outputs, plain))


def test_min_tokens_holds_back_stop_tokens_like_transformers(model_dir, hf_model) -> None:
    prompt = random_prompts(1, seed=12, lo=8, hi=9)[0]
    with LLM(model_dir, num_blocks=128) as llm:
        plain = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                             progress=False)[0].token_ids
        stop = plain[1]  # the second token would stop the request at once
        params = [SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop], min_tokens=k) for k in (0, 4)]
        early, held = llm.generate([prompt, prompt], params, progress=False)
        eos_token_ids = list(llm.model_config.eos_token_ids)
    assert early.token_ids == plain[:2] and early.finish_reason == "stop"
    assert stop not in held.token_ids[:4] and len(held.token_ids) > 4
    assert held.token_ids == hf_adjusted_greedy(hf_model, prompt, params[1], eos_token_ids=[stop, *eos_token_ids])


def preempted_params(num_prompts: int) -> list[SamplingParams]:
    """OpenAI's penalties and vLLM's repetition penalty, in turn."""
    mix = [*PENALISED[:3], *REPEATED]
    return [mix[i % len(mix)] for i in range(num_prompts)]


def test_penalties_survive_preemption_and_overlapped_steps(model_dir) -> None:
    """A preempted request restarts with the tokens it had generated, and its prompt for a repetition penalty
    (prefix-cache hits skip them on the worker), and overlapped steps count samples the host has not seen yet:
    the tokens do not change."""
    prompts = random_prompts(8, seed=13, lo=10, hi=30)
    params = preempted_params(len(prompts))
    plain, overlapped = generate_both(model_dir, prompts, params, block_size=4, num_blocks=40,
                                      max_num_batched_tokens=64)
    assert_same(plain, overlapped)
    with LLM(model_dir, num_blocks=256) as llm:
        roomy = llm.generate(prompts, params, progress=False)
    assert_same(roomy, plain)


def test_tight_cache_preempts_requests_that_have_generated_tokens(model_dir) -> None:
    """The premise of the test above: its cache is tight enough to preempt requests mid-output."""
    prompts = random_prompts(8, seed=13, lo=10, hi=30)
    params = preempted_params(len(prompts))
    with LLM(model_dir, block_size=4, num_blocks=40, max_num_batched_tokens=64) as llm:
        scheduler = llm.engine.scheduler
        preempt, outputs_at_preemption = scheduler._preempt, []

        def recording_preempt(request):
            outputs_at_preemption.append((request.sampling_params.penalizes_prompt, request.num_output_tokens))
            return preempt(request)

        scheduler._preempt = recording_preempt
        llm.generate(prompts, params, progress=False)
    # Requests with OpenAI's penalties only, and with a repetition penalty, both.
    assert {repeated for repeated, num_outputs in outputs_at_preemption if num_outputs > 0} == {False, True}
