"""On a GPU, greedy outputs of ``LLM(device="cuda", dtype="float32")`` through the CUDA
attention kernels equal transformers' ``generate()`` in float32 on the GPU, token for token.

The tiny models use head dims the kernels support (64, 128); the default tiny shape
(head_dim 16) would fall back to the torch reference.  Matrix products stay float32
(``torch.backends.cuda.matmul.allow_tf32`` is off by default) on both sides.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.worker.layers.attention import Attention
from kvserve.worker.tiny_model import create_tiny_model
from tests.engine.hf_reference import hf_greedy, hf_log_softmax, load_hf_model
from tests.engine.test_llm_parity import FAMILIES, random_prompts

pytestmark = pytest.mark.gpu

MODELS = {
    # GQA 4:2 (decode tiles of 4 rows, 2 masked), head_dim 64, llama3 rope scaling
    "llama": dict(FAMILIES["llama"], head_dim=64),
    # GQA 4:1, head_dim 128
    "mistral": dict(FAMILIES["mistral"], head_dim=128),
    # MHA (one query head per kv head), q/k norm, head_dim 64
    "qwen3": dict(FAMILIES["qwen3"], head_dim=64),
}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(MODELS))
def cuda_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    family = request.param
    path = create_tiny_model(tmp_path_factory.mktemp(family), family, seed=7, **MODELS[family])
    return path, load_hf_model(path).to("cuda")


def attention_backend_names(llm: LLM) -> set[str]:
    model = llm.engine.executor.worker.model
    return {module.backend.name for module in model.modules() if isinstance(module, Attention)}


def generate_on_cuda(path: Path, prompts: list[list[int]], **llm_args) -> list[list[int]]:
    with LLM(path, device="cuda", dtype="float32", **llm_args) as llm:
        assert attention_backend_names(llm) == {"cuda"}
        outputs = llm.generate(prompts, GREEDY)
    return [output.token_ids for output in outputs]


def test_batch_of_different_lengths_matches_transformers(cuda_model) -> None:
    path, hf = cuda_model
    prompts = random_prompts(5, seed=1)
    assert generate_on_cuda(path, prompts, block_size=16, num_blocks=128) == hf_greedy(hf, prompts, GREEDY.max_tokens)


def test_chunked_prefill_over_cached_context_matches_transformers(cuda_model) -> None:
    path, hf = cuda_model
    prompts = random_prompts(4, seed=2, lo=30, hi=70)
    tokens = generate_on_cuda(path, prompts, block_size=32, num_blocks=64, max_num_batched_tokens=7)
    assert tokens == hf_greedy(hf, prompts, GREEDY.max_tokens)


def test_long_prompts_spanning_several_splits_match_transformers(cuda_model) -> None:
    path, hf = cuda_model
    # Contexts past 1000 tokens: decode rows of a small batch are cut into several splits.
    prompts = random_prompts(2, seed=3, lo=900, hi=1200)
    tokens = generate_on_cuda(path, prompts, block_size=16, num_blocks=256)
    assert tokens == hf_greedy(hf, prompts, GREEDY.max_tokens)


def test_prompt_logprobs_over_chunks_match_transformers(cuda_model) -> None:
    path, hf = cuda_model
    prompt = random_prompts(1, seed=4, lo=60, hi=61)[0]
    with LLM(path, device="cuda", dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=24) as llm:
        output = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=2))[0]
    reference = hf_log_softmax(hf, prompt[:1], prompt[1:])
    expected = reference.gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
    got = torch.tensor([entry.logprob for entry in output.prompt_logprobs[1:]])
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)
    assert [list(e.top_token_ids) for e in output.prompt_logprobs[1:]] == reference.topk(2, dim=-1).indices.tolist()


def test_float32_is_what_both_sides_compute_in() -> None:
    assert not torch.backends.cuda.matmul.allow_tf32
