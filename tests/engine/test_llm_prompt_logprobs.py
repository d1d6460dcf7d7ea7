"""Prompt logprobs: each prompt token's log-probability given the tokens before it, as transformers computes it.

The reference is one float32 forward pass of transformers over the prompt
(``hf_log_softmax``).  The prompt's chunks (chunked prefill), the prefix cache
(whose tokens have no logits), preemption, overlapped steps and tensor
parallelism must not change them.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.worker import prompt_logprobs as worker_prompt_logprobs
from kvserve.worker.tiny_model import create_tiny_model
from tests.engine.hf_reference import hf_log_softmax, load_hf_model
from tests.engine.test_llm_async_scheduling import assert_same, generate_both
from tests.engine.test_llm_parity import random_prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return create_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=3)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_hf_model(model_dir)


def assert_prompt_logprobs_match(hf_model, prompt: list[int], prompt_logprobs, num_top: int) -> None:
    """``prompt_logprobs`` (None, then one per prompt token after the first) equal transformers' own."""
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    # Row i of the reference predicts prompt[i + 1].
    reference = hf_log_softmax(hf_model, prompt[:1], prompt[1:])
    expected = reference.gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
    got = torch.tensor([entry.logprob for entry in prompt_logprobs[1:]])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    best = reference.topk(num_top, dim=-1)
    assert [list(entry.top_token_ids) for entry in prompt_logprobs[1:]] == best.indices.tolist()
    top = torch.tensor([list(entry.top_logprobs) for entry in prompt_logprobs[1:]]).reshape(best.values.shape)
    torch.testing.assert_close(top, best.values, atol=1e-4, rtol=0)


def test_prompt_logprobs_over_chunks_equal_transformers(model_dir, hf_model) -> None:
    prompts = random_prompts(4, seed=21, lo=20, hi=70)
    params = [SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=k) for k in (0, 3, None, 1)]
    with LLM(model_dir, num_blocks=128, block_size=8, max_num_batched_tokens=24) as llm:  # chunks of <= 24
        outputs = llm.generate(prompts, params, progress=False)
    for prompt, param, output in zip(prompts, params, outputs):
        if param.prompt_logprobs is None:
            assert output.prompt_logprobs is None
        else:
            assert_prompt_logprobs_match(hf_model, prompt, output.prompt_logprobs, param.prompt_logprobs)
    # The prompt logprobs leave the sampled tokens as they were.
    with LLM(model_dir, num_blocks=128) as llm:
        plain = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0), progress=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]


def test_logits_are_computed_in_slices_with_the_same_result(model_dir, hf_model, monkeypatch) -> None:
    monkeypatch.setattr(worker_prompt_logprobs, "MAX_LOGITS_AT_ONCE", 3 * 1000)  # 3 positions at a time
    prompt = random_prompts(1, seed=22, lo=30, hi=31)[0]
    with LLM(model_dir, num_blocks=128) as llm:
        output = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=2), progress=False)[0]
    assert_prompt_logprobs_match(hf_model, prompt, output.prompt_logprobs, 2)


def test_a_one_token_prompt_has_no_prompt_logprob(model_dir) -> None:
    with LLM(model_dir, num_blocks=64) as llm:
        output = llm.generate([[5]], SamplingParams(max_tokens=2, prompt_logprobs=1), progress=False)[0]
    assert output.prompt_logprobs == [None]


def test_a_request_with_prompt_logprobs_reads_no_cached_tokens_but_fills_the_cache(model_dir, hf_model) -> None:
    prompt = random_prompts(1, seed=23, lo=40, hi=41)[0]
    with LLM(model_dir, num_blocks=128, block_size=8) as llm:
        first = llm.generate([prompt], SamplingParams(max_tokens=2), progress=False)[0]
        asking = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=0), progress=False)[0]
        after = llm.generate([prompt], SamplingParams(max_tokens=2), progress=False)[0]
    assert first.num_cached_tokens == 0 and asking.num_cached_tokens == 0 and after.num_cached_tokens == 32
    assert_prompt_logprobs_match(hf_model, prompt, asking.prompt_logprobs, 0)


def test_preemption_mid_prompt_and_overlapped_steps_keep_the_prompt_logprobs(model_dir, hf_model) -> None:
    """A request preempted after some of its chunks keeps their logprobs, reads from the cache only what
    they cover, and recomputes the rest; overlapped steps give the same."""
    prompts = random_prompts(6, seed=24, lo=30, hi=60)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=1 if i % 2 else None)
              for i in range(len(prompts))]
    preempted_mid_prompt = []
    with LLM(model_dir, block_size=4, num_blocks=40, max_num_batched_tokens=16) as llm:
        scheduler = llm.engine.scheduler
        preempt = scheduler._preempt

        def recording_preempt(request):
            logprobs = request.prompt_logprobs
            preempted_mid_prompt.append(logprobs is not None and 0 < len(logprobs) < request.num_prompt_tokens - 1)
            return preempt(request)

        scheduler._preempt = recording_preempt
        tight = llm.generate(prompts, params, progress=False)
    assert any(preempted_mid_prompt)
    for prompt, output in zip(prompts, tight):
        if output.prompt_logprobs is not None:
            assert_prompt_logprobs_match(hf_model, prompt, output.prompt_logprobs, 1)
    plain, overlapped = generate_both(model_dir, prompts, params, block_size=4, num_blocks=40,
                                      max_num_batched_tokens=16)
    assert_same(plain, overlapped)
    assert_same(tight, overlapped)
