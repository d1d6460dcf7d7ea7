"""Seeded sampling through the engine does not depend on what else is in the batch; min-p keeps to its threshold."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvserve import LLM, SamplingParams
from kvserve.worker.tiny_model import create_tiny_model
from tests.engine.test_llm_parity import random_prompts


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    path = create_tiny_model(tmp_path_factory.mktemp("m"), "llama", seed=1)
    with LLM(path, block_size=4, num_blocks=256, max_num_batched_tokens=32, seed=123) as engine:
        yield engine


SEEDED = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=42, ignore_eos=True)


def test_seeded_request_gives_the_same_tokens_alone_and_in_any_batch(llm: LLM) -> None:
    prompt = random_prompts(1, seed=8)[0]
    others = random_prompts(5, seed=9)
    alone = llm.generate([prompt], SEEDED)[0].token_ids
    unseeded = SamplingParams(max_tokens=15, temperature=1.0, ignore_eos=True)
    first = llm.generate([prompt] + others, [SEEDED] + [unseeded] * 5)[0].token_ids
    last = llm.generate(others[:3] + [prompt], [unseeded] * 3 + [SEEDED])[3].token_ids
    assert alone == first == last


def test_a_different_seed_gives_different_tokens(llm: LLM) -> None:
    prompt = random_prompts(1, seed=8)[0]
    a = llm.generate([prompt], SEEDED)[0].token_ids
    b = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=43, ignore_eos=True))[0].token_ids
    assert a != b


def test_sampled_tokens_come_with_their_logprobs_when_asked(llm: LLM) -> None:
    (output,) = llm.generate([[5, 6, 7]], dataclasses.replace(SEEDED, logprobs=0))
    assert len(output.logprobs) == len(output.token_ids) == 20
    assert all(t.logprob <= 0.0 and t.top_token_ids == () for t in output.logprobs)


def test_seeded_min_p_is_reproducible_and_samples_no_token_below_its_threshold(llm: LLM) -> None:
    prompt = random_prompts(1, seed=8)[0]
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=42, ignore_eos=True, logprobs=1, min_p=0.3)
    alone = llm.generate([prompt], params)[0]
    in_batch = llm.generate(random_prompts(3, seed=9) + [prompt], [SEEDED] * 3 + [params])[3]
    plain = llm.generate([prompt], dataclasses.replace(params, min_p=0.0))[0]

    assert in_batch.token_ids == alone.token_ids
    # At temperature 1 without penalties the logprobs are of the distribution sampled from, and the
    # first alternative is the most likely token: each sampled token is at least 0.3 times as likely.
    threshold = math.log(0.3)
    assert all(t.logprob - t.top_logprobs[0] >= threshold - 1e-5 for t in alone.logprobs)
    assert any(t.logprob - t.top_logprobs[0] < threshold for t in plain.logprobs)  # which sampling without it breaks
