"""``LLM.shutdown()`` (and ``with LLM(...)``) gives back the worker's memory; a second LLM starts."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.worker.tiny_model import create_tiny_model

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return create_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1)


def test_shutdown_releases_the_cache_and_weights(model_dir) -> None:
    llm = LLM(model_dir, num_blocks=64)
    worker = llm.engine.executor.worker
    cache = weakref.ref(worker.kv_caches[0][0])
    weight = weakref.ref(next(worker.model.parameters()))
    first = llm.generate([[5, 6, 7]], GREEDY)
    llm.shutdown()
    gc.collect()
    assert cache() is None and weight() is None
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[5, 6, 7]], GREEDY)
    llm.shutdown()  # a second call is harmless
    with LLM(model_dir, num_blocks=64) as second:
        assert second.generate([[5, 6, 7]], GREEDY)[0].token_ids == first[0].token_ids


def test_a_dropped_llm_frees_its_memory_with_garbage_collection(model_dir) -> None:
    llm = LLM(model_dir, num_blocks=64)
    cache = weakref.ref(llm.engine.executor.worker.kv_caches[0][0])
    del llm
    gc.collect()
    assert cache() is None


@pytest.mark.gpu
def test_a_second_llm_gets_the_whole_gpu_after_del_or_shutdown(tmp_path) -> None:
    # KV blocks of 2 MiB (8 layers x 16 KV heads x 128 x 32 tokens, bf16): most of a GPU in
    # tens of thousands of blocks, not the tens of millions of the default tiny shape's.
    model_dir = create_tiny_model(tmp_path / "m", seed=1, num_hidden_layers=8, hidden_size=256, head_dim=128,
                                  num_attention_heads=16, num_key_value_heads=16, intermediate_size=512)
    baseline = torch.cuda.memory_allocated()
    for release in ("shutdown", "del"):
        # The cache takes most of the GPU.
        llm = LLM(model_dir, device="cuda", block_size=32, gpu_memory_utilization=0.8)
        assert torch.cuda.memory_allocated() - baseline > 0.5 * torch.cuda.mem_get_info()[1]
        assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
        if release == "shutdown":
            llm.shutdown()
            assert torch.cuda.memory_allocated() - baseline < 64 << 20
        del llm
    with LLM(model_dir, device="cuda", block_size=32, gpu_memory_utilization=0.8) as last:
        assert last.generate([[5, 6, 7]], GREEDY)[0].token_ids
