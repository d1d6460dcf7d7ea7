"""The in-process engine after a step that failed: nothing it did not compute may be served from the cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.worker.tiny_model import create_tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [(7 * i) % 900 + 3 for i in range(64)]  # 16 blocks of 4, 4 prefill steps of 16 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("failures-model"), "llama", seed=0)


@pytest.mark.parametrize("failing_step", [1, 2, 3, 5])
def test_a_step_that_fails_leaves_no_block_it_never_wrote_in_the_prefix_cache(model_dir: Path, failing_step: int):
    # Blocks are cached when their step is scheduled.  Ctrl-C (or a worker
    # error) during the step's forward pass aborted the requests, but the
    # blocks stayed cached: the same prompt then "hit" 16-48 tokens of KV
    # that was never written and generated other tokens.
    with LLM(str(model_dir), block_size=4, num_blocks=64, max_num_batched_tokens=16) as llm:
        # The same computation under another salt: no block is shared with the runs below.
        expected = llm.generate([PROMPT], GREEDY, cache_salt="clean")[0].token_ids
        execute = llm.engine.executor.execute
        calls = 0

        def interrupted(plan):  # noqa: ANN001, ANN202
            nonlocal calls
            calls += 1
            if calls == failing_step:
                raise KeyboardInterrupt
            return execute(plan)

        llm.engine.executor.execute = interrupted
        with pytest.raises(KeyboardInterrupt):
            llm.generate([PROMPT], GREEDY)
        llm.engine.executor.execute = execute
        again = llm.generate([PROMPT], GREEDY)[0]

    computed_blocks = min(failing_step - 1, 4) * 4  # the steps that ran wrote 16 tokens = 4 blocks each
    assert again.num_cached_tokens == min(computed_blocks * 4, len(PROMPT) - 4)
    assert again.token_ids == expected


def test_llm_takes_the_engines_settings_by_name_and_refuses_others(tmp_path) -> None:
    from kvserve.scheduler.engine_config import EngineConfig

    path = create_tiny_model(tmp_path, "llama", seed=0)
    with LLM(path, num_blocks=32, block_size=8, max_num_seqs=4) as llm:
        assert llm.config == EngineConfig.from_kwargs(str(path), num_blocks=32, block_size=8, max_num_seqs=4)
        assert llm.engine.scheduler.kv_cache_manager.block_size == 8
    with pytest.raises(TypeError, match="unexpected setting 'kv_cache_memory'"):
        LLM(path, kv_cache_memory=1)
    with pytest.raises(ValueError, match="LLM runs one replica"):
        LLM(path, num_replicas=2)


def test_settings_that_need_max_model_len_are_refused_before_a_worker_starts(tmp_path, monkeypatch) -> None:
    # They were refused only after the ranks had started and loaded the weights.
    import kvserve.worker.uniproc_executor as uniproc

    path = create_tiny_model(tmp_path, "llama", seed=0)

    def no_worker(*args, **kwargs):
        raise AssertionError("a worker started")

    monkeypatch.setattr(uniproc, "UniprocExecutor", no_worker)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_model_len when chunked prefill is off"):
        LLM(path, enable_chunked_prefill=False, max_num_batched_tokens=1000)


def test_a_kv_cache_budget_too_small_for_two_blocks_names_the_setting_and_what_it_takes(model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"^cpu_kv_cache_bytes is 1: this rank's KV cache gets 1 bytes, 0 blocks "
                       r"of (\d+) bytes; at least 2 blocks \(\d+ bytes\) are needed$") as info:
        LLM(str(model_dir), cpu_kv_cache_bytes=1)
    block_bytes = int(info.value.args[0].split(" blocks of ")[1].split()[0])
    # The figure it asks for is enough.
    with LLM(str(model_dir), cpu_kv_cache_bytes=2 * block_bytes) as llm:
        assert llm.engine.scheduler.kv_cache_manager.block_pool.num_blocks == 2
