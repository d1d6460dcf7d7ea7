"""``LLM.generate`` interrupted, run from two threads, or left by a dead rank: no wrong tokens, clear errors."""

from __future__ import annotations

import _thread
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest

import kvserve
from kvserve import LLM, SamplingParams, WorkerProcessError
from kvserve.worker.tiny_model import create_tiny_model

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
LONG = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
LONG_PROMPTS = [[i + 2] * 30 for i in range(32)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("interruptions-model"), "llama", seed=0)


def _ctrl_c_once_decoding(llm: LLM) -> threading.Thread:
    """Ctrl-C as a terminal sends it, once ``llm`` decodes: SIGINT to the ranks, KeyboardInterrupt here."""

    def interrupt() -> None:
        while not any(r.num_output_tokens for r in llm.engine.scheduler.running):
            time.sleep(0.005)
        for rank in multiprocessing.active_children():
            os.kill(rank.pid, signal.SIGINT)
        _thread.interrupt_main()

    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_two_ranks_give_the_right_tokens_after_an_interrupted_generate(model_dir: Path) -> None:
    # The caller's wait for the ranks' replies was interrupted, their replies stayed
    # in the pipes, and every later step read the one before it: wrong tokens and no
    # error (with async scheduling, "asked for before those of [...]" for good).
    with LLM(model_dir, tensor_parallel_size=2) as llm:
        expected = llm.generate([[5] * 10], GREEDY)[0].token_ids
        for async_scheduling in (False, True):
            llm.engine.async_scheduling = async_scheduling
            interrupter = _ctrl_c_once_decoding(llm)
            with pytest.raises(KeyboardInterrupt):
                llm.generate(LONG_PROMPTS, LONG)
            interrupter.join()
            assert [llm.generate([[5] * 10], GREEDY)[0].token_ids for _ in range(3)] == [expected] * 3


def test_worker_process_error_is_importable_from_kvserve() -> None:
    # generate raises it once a rank has died; it was importable only from kvserve.worker.multiproc_executor.
    from kvserve.worker import multiproc_executor

    assert kvserve.WorkerProcessError is multiproc_executor.WorkerProcessError
    assert issubclass(kvserve.WorkerProcessError, RuntimeError)
    assert "WorkerProcessError" in kvserve.__all__


@pytest.mark.slow
def test_a_dead_rank_is_named_on_every_later_call(model_dir: Path) -> None:
    # It was a BrokenPipeError from the pipe to the dead rank.
    with LLM(model_dir, tensor_parallel_size=2) as llm:
        llm.generate([[5] * 10], GREEDY)
        (rank1,) = [p for p in multiprocessing.active_children() if p.name == "kvserve-rank1"]
        rank1.kill()
        rank1.join()
        for _ in range(2):
            with pytest.raises(WorkerProcessError, match=r"rank 1 exited unexpectedly \(exit code -9\)"):
                llm.generate([[5] * 10], GREEDY)


def test_generate_calls_from_two_threads_run_one_after_the_other(model_dir: Path) -> None:
    # One thread got an internal ValueError, the other empty outputs with finish_reason "abort".
    with LLM(model_dir) as llm:
        expected = [o.token_ids for o in llm.generate(LONG_PROMPTS[:8], LONG)]
        outputs: dict[int, list] = {}
        errors: dict[int, BaseException] = {}

        def run(i: int) -> None:
            try:
                outputs[i] = llm.generate(LONG_PROMPTS[:8], LONG)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == {}
    for i in range(2):
        assert [o.token_ids for o in outputs[i]] == expected
        assert {o.finish_reason for o in outputs[i]} == {"length"}


def test_cpu_threads_leaves_the_callers_torch_threads_as_it_found_them(model_dir: Path) -> None:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with LLM(model_dir, cpu_threads=1, device="cpu"):
            assert torch.get_num_threads() == 1  # set while it runs: else "put back" is "never touched"
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_dict_as_sampling_params_is_refused_by_its_type(model_dir: Path) -> None:
    with LLM(model_dir) as llm:
        with pytest.raises(TypeError, match="sampling_params must be SamplingParams or a list of them, got dict"):
            llm.generate([[5] * 10], {"max_tokens": 4})  # type: ignore[arg-type]


def test_a_prompt_longer_than_the_sliding_window_names_the_window(tmp_path: Path) -> None:
    path = create_tiny_model(tmp_path / "m", "mistral", seed=0, sliding_window=8)
    with LLM(path) as llm:
        with pytest.raises(ValueError, match="more than max_model_len=8 .*capped to the model's sliding window of 8"):
            llm.generate([[5] * 20], GREEDY)
        assert len(llm.generate([[5] * 6], GREEDY)[0].token_ids) == 2  # capped by max_model_len=8
