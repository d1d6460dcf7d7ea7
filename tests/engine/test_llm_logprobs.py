"""``SamplingParams.logprobs``: the engine's logprobs are transformers' ``log_softmax`` of the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.worker.tiny_model import create_tiny_model
from tests.engine.hf_reference import hf_log_softmax, load_hf_model
from tests.engine.test_llm_parity import random_prompts

MAX_TOKENS = 12
# float32 on both sides; the paged attention sums in another order than transformers'.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("logprobs"), "llama", seed=3)


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    with LLM(model_dir, block_size=4, num_blocks=256, max_num_batched_tokens=32) as engine:
        yield engine


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    return load_hf_model(model_dir)


def test_greedy_logprobs_and_alternatives_equal_transformers_log_softmax(llm: LLM, hf_model) -> None:
    prompt = random_prompts(1, seed=21, lo=20, hi=30)[0]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    (output,) = llm.generate([prompt], params)
    reference = hf_log_softmax(hf_model, prompt, output.token_ids)

    assert len(output.logprobs) == len(output.token_ids) == MAX_TOKENS
    expected = reference.gather(-1, torch.tensor(output.token_ids)[:, None]).squeeze(-1)
    assert [t.logprob for t in output.logprobs] == pytest.approx(expected.tolist(), abs=TOLERANCE)
    top = reference.topk(5, dim=-1)
    assert [list(t.top_logprobs) for t in output.logprobs] == [
        pytest.approx(row, abs=TOLERANCE) for row in top.values.tolist()
    ]
    assert [list(t.top_token_ids) for t in output.logprobs] == top.indices.tolist()


def test_a_greedy_tokens_logprob_is_the_most_likely_one(llm: LLM) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    (output,) = llm.generate(random_prompts(1, seed=22), params)
    for token_id, logprobs in zip(output.token_ids, output.logprobs, strict=True):
        assert logprobs.top_token_ids == (token_id,)
        assert logprobs.logprob == logprobs.top_logprobs[0] <= 0.0


def test_sampled_tokens_logprobs_are_the_raw_distributions_not_the_tempered_one(llm: LLM, hf_model) -> None:
    prompt = random_prompts(1, seed=23)[0]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.7, top_k=7, seed=5, ignore_eos=True, logprobs=0)
    (output,) = llm.generate([prompt], params)
    reference = hf_log_softmax(hf_model, prompt, output.token_ids)

    expected = reference.gather(-1, torch.tensor(output.token_ids)[:, None]).squeeze(-1)
    assert [t.logprob for t in output.logprobs] == pytest.approx(expected.tolist(), abs=TOLERANCE)
    assert all(t.top_token_ids == () == t.top_logprobs for t in output.logprobs)


def test_only_the_requests_that_ask_get_logprobs(llm: LLM) -> None:
    prompts = random_prompts(4, seed=24)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    asking = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts, [greedy, asking, greedy, asking])

    assert [o.logprobs is None for o in outputs] == [True, False, True, False]
    assert [len(o.logprobs) for o in outputs[1::2]] == [MAX_TOKENS] * 2
    # Asking changes nothing about the tokens.
    assert [o.token_ids for o in outputs[1::2]] == [o.token_ids for o in llm.generate(prompts[1::2], greedy)]


def test_each_completions_cumulative_logprob_is_the_sum_of_its_sampled_tokens_logprobs(llm: LLM, hf_model) -> None:
    # vLLM's CompletionOutput.cumulative_logprob; kvserve's outputs had no such field.
    prompt = random_prompts(1, seed=25)[0]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=9, ignore_eos=True, logprobs=0, n=2)
    (output,) = llm.generate([prompt], params)

    for completion in output.outputs:
        reference = hf_log_softmax(hf_model, prompt, completion.token_ids)
        expected = reference.gather(-1, torch.tensor(completion.token_ids)[:, None]).sum().item()
        assert completion.cumulative_logprob == pytest.approx(expected, abs=MAX_TOKENS * TOLERANCE)
        assert completion.cumulative_logprob == pytest.approx(sum(t.logprob for t in completion.logprobs))
        assert completion.cumulative_logprob < 0.0
    assert output.outputs[0].cumulative_logprob != output.outputs[1].cumulative_logprob


def test_cumulative_logprob_is_none_when_logprobs_were_not_asked_for(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (output,) = llm.generate(random_prompts(1, seed=26), params)
    assert output.outputs[0].cumulative_logprob is None
