"""Greedy outputs of ``LLM.generate`` equal transformers' ``generate()`` token for token."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.worker.tiny_model import create_tiny_model
from tests.engine.hf_reference import hf_greedy, load_hf_model

FAMILIES = {
    # GQA 4:2, untied embeddings, llama3 rope scaling
    "llama": dict(
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64),
        tie_word_embeddings=False,
    ),
    # GQA 4:1, default rope
    "mistral": dict(num_key_value_heads=1),
    # QKV bias, tied embeddings
    "qwen2": dict(tie_word_embeddings=True),
    # q/k norm, linear rope scaling, MHA
    "qwen3": dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
                  num_key_value_heads=4),
}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def random_prompts(n: int, seed: int, lo: int = 3, hi: int = 60, shared: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = shared or []
    return [prefix + [rng.randrange(3, 1000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    family = request.param
    path = create_tiny_model(tmp_path_factory.mktemp(family), family, seed=7, **FAMILIES[family])
    return family, path, load_hf_model(path)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=3, **FAMILIES["llama"])


@pytest.fixture(scope="module")
def llama_hf(llama_dir: Path):
    return load_hf_model(llama_dir)


def test_batch_of_different_lengths_matches_transformers(family_model) -> None:
    _, path, hf = family_model
    prompts = random_prompts(5, seed=1)
    with LLM(path, block_size=16, num_blocks=128) as llm:
        outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == hf_greedy(hf, prompts, GREEDY.max_tokens)
    assert all(o.finish_reason == "length" for o in outputs)


def test_eos_stops_generation_like_transformers(llama_dir: Path, llama_hf) -> None:
    prompts = random_prompts(6, seed=11)
    with LLM(llama_dir, num_blocks=128) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0))
    expected = hf_greedy(llama_hf, prompts, 64, stop_at_eos=True)
    assert [o.token_ids for o in outputs] == expected
    eos = llama_hf.generation_config.eos_token_id
    assert [o.finish_reason for o in outputs] == ["stop" if e[-1] == eos else "length" for e in expected]


def test_chunked_prefill_over_many_steps_matches(llama_dir: Path, llama_hf) -> None:
    prompts = random_prompts(4, seed=2, lo=30, hi=70)
    with LLM(llama_dir, block_size=4, num_blocks=256, max_num_batched_tokens=7) as llm:
        outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == hf_greedy(llama_hf, prompts, GREEDY.max_tokens)


def test_shared_prefixes_hit_the_cache_and_still_match(llama_dir: Path, llama_hf) -> None:
    shared = [random.Random(5).randrange(3, 1000) for _ in range(40)]
    prompts = random_prompts(4, seed=5, lo=2, hi=12, shared=shared)
    with LLM(llama_dir, block_size=8, num_blocks=128) as llm:
        first = llm.generate(prompts[:1], GREEDY)
        rest = llm.generate(prompts[1:], GREEDY)
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 40 for o in rest)
    assert [o.token_ids for o in first + rest] == hf_greedy(llama_hf, prompts, GREEDY.max_tokens)


def test_preemption_under_memory_pressure_keeps_outputs(llama_dir: Path, llama_hf) -> None:
    prompts = random_prompts(6, seed=9, lo=10, hi=20)
    with LLM(llama_dir, block_size=4, num_blocks=24, max_num_batched_tokens=64) as llm:
        preempted: list[str] = []
        executor = llm.engine.executor
        original_execute = executor.execute

        def recording_execute(plan):
            preempted.extend(plan.preempted_req_ids)
            return original_execute(plan)

        executor.execute = recording_execute
        outputs = llm.generate(prompts, GREEDY)
        assert llm.engine.scheduler.kv_cache_manager.get_num_free_blocks() == 23
    assert preempted, "the pool was meant to be too small for every request at once"
    assert [o.token_ids for o in outputs] == hf_greedy(llama_hf, prompts, GREEDY.max_tokens)


def test_text_prompts_are_tokenized_and_outputs_detokenized(llama_dir: Path, llama_hf) -> None:
    with LLM(llama_dir, num_blocks=64) as llm:
        (output,) = llm.generate("The river ran", GREEDY)
        tokenizer = llm.tokenizer
    prompt_ids = tokenizer("The river ran")["input_ids"]
    assert output.prompt_token_ids == prompt_ids
    assert output.token_ids == hf_greedy(llama_hf, [prompt_ids], GREEDY.max_tokens)[0]
    assert output.text == tokenizer.decode(output.token_ids, skip_special_tokens=True)


def test_out_of_vocabulary_prompt_is_rejected(llama_dir: Path) -> None:
    with LLM(llama_dir, num_blocks=64) as llm:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([[5, 10_000_000]], GREEDY)
        assert llm.generate([[5, 6]], SamplingParams(max_tokens=2))[0].token_ids  # still serving


def test_out_of_vocabulary_stop_token_ids_are_rejected_as_the_cluster_rejects_them(llama_dir: Path) -> None:
    # They could never be sampled: accepted, they silently stopped nothing.
    with LLM(llama_dir, num_blocks=64) as llm:
        vocab_size = llm.model_config.vocab_size
        bad = SamplingParams(max_tokens=2, stop_token_ids=[3, vocab_size])
        with pytest.raises(ValueError, match=rf"stop_token_ids: {vocab_size} is outside the vocabulary"):
            llm.generate([[5, 6], [7, 8]], [SamplingParams(max_tokens=2), bad])
        assert not llm.engine.has_unfinished_requests()  # nothing of the refused call was queued
        edge = SamplingParams(max_tokens=2, stop_token_ids=[vocab_size - 1])
        assert len(llm.generate([[5, 6]], edge)[0].token_ids) >= 1


def test_token_ids_as_arrays_and_tensors_are_prompts(llama_dir: Path) -> None:
    # A 1-D array or tensor was taken for a list of prompts, and failed on its first element.
    import numpy as np
    import torch

    prompt = [5, 6, 7, 8]
    with LLM(llama_dir, num_blocks=64) as llm:
        expected = llm.generate(prompt, GREEDY)[0].token_ids
        for prompts in (np.array(prompt), torch.tensor(prompt), [np.int64(5), 6, 7, 8], list(torch.tensor(prompt))):
            assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [expected]
        assert [o.token_ids for o in llm.generate(torch.tensor([prompt, prompt]), GREEDY)] == [expected] * 2


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([[1.5, 2]], "prompt token ids must be integers, got 1.5"),  # truncated to 1
        ([[True, 3]], "prompt token ids must be integers, got True"),  # read as 1
        ([[2, 3], 5], "a prompt must be a string or a sequence of token ids, got 5"),
        ([[[2, 3]]], r"prompt token ids must be integers, got \[2, 3\]"),
        ([0, 5, 1.5], "prompt token ids must be integers, got 1.5"),  # it blamed the 0
        (None, "prompts must be a string, token ids or a list of them, got None"),  # a TypeError
        ({7, 5, 300}, "got set"),  # taken as the prompt [300, 5, 7]
        (b"hello", "got bytes"),  # taken as token ids
    ],
)
def test_prompts_that_are_not_token_ids_are_refused(llama_dir: Path, prompts: object, message: str) -> None:
    with LLM(llama_dir, num_blocks=64) as llm:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompts, GREEDY)
        assert not llm.engine.has_unfinished_requests()


def test_a_sliding_window_model_is_served_within_its_window(tmp_path: Path) -> None:
    # Mistral 7B v0.1's kind of config (a window under max_position_embeddings) was refused outright.
    path = create_tiny_model(tmp_path / "m", "mistral", seed=2, sliding_window=48, num_key_value_heads=1)
    prompts = random_prompts(3, seed=2, lo=20, hi=40)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(path, block_size=8, num_blocks=64) as llm:
        assert llm.model_config.max_model_len == 48
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
    assert tokens == hf_greedy(load_hf_model(path), prompts, 8)


def test_loading_a_sliding_window_model_warns_once_that_its_context_is_capped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A Mistral config with max_position_embeddings=256 served 8 tokens a sequence, and said nothing.
    path = create_tiny_model(tmp_path / "m", "mistral", seed=2, sliding_window=8, max_position_embeddings=256)
    with caplog.at_level(logging.WARNING):
        with LLM(path, block_size=4, num_blocks=16) as llm:
            assert llm.model_config.max_model_len == 8
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))
    capped = [r for r in caplog.records if "sliding window" in r.getMessage()]
    assert len(capped) == 1
    assert capped[0].levelno == logging.WARNING
    assert "capped to the model's sliding window of 8 tokens" in capped[0].getMessage()
