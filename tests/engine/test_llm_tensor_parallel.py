"""``LLM(tensor_parallel_size=2)`` runs its ranks in two processes and matches one rank."""

from __future__ import annotations

from pathlib import Path

import multiprocessing

import pytest

from kvserve import LLM, SamplingParams
from kvserve.worker.tiny_model import create_tiny_model
from tests.engine.hf_reference import hf_greedy, load_hf_model
from tests.engine.test_llm_parity import random_prompts


@pytest.mark.slow
def test_two_ranks_give_the_greedy_tokens_of_transformers(tmp_path: Path) -> None:
    # One KV head with two ranks: the KV head is replicated on both.
    path = create_tiny_model(tmp_path / "m", "llama", seed=4, num_key_value_heads=1)
    prompts = random_prompts(4, seed=4, lo=5, hi=40)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(path, tensor_parallel_size=2, block_size=8, num_blocks=64, max_num_batched_tokens=32) as llm:
        outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == hf_greedy(load_hf_model(path), prompts, 16)


def test_a_size_that_cannot_split_the_model_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    # The ranks' processes found out after starting (18 s here), as a RuntimeError.
    path = create_tiny_model(tmp_path / "m", "llama", seed=4)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 cannot split the model in .*: it must divide the 4"):
        LLM(path, tensor_parallel_size=3)
    assert multiprocessing.active_children() == []
