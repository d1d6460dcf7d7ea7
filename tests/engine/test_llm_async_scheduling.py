"""Overlapped (async) scheduling gives the plain engine's outputs, token for token.

Step N+1 is planned before step N's tokens are applied: requests sampled by N are
planned with placeholders that the worker fills with its own samples; stops are
seen a step late.  Greedy and seeded sampling depend only on each request's own
tokens, so every output must equal the non-overlapped engine's, through chunked
prefill, prefix-cache hits, EOS stops and preemption.
"""

from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.worker.tiny_model import create_tiny_model
from tests.engine.test_llm_parity import random_prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return create_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=3)


def generate_both(model_dir, prompts, params, overlapped_setting: bool | None = True, steps_ahead: int = 1,
                  **llm_args):
    """Outputs with ``async_scheduling=False`` and with ``overlapped_setting`` (``None``: the
    default, which must overlap for these ``llm_args``), ``steps_ahead`` steps left in flight."""
    results = {}
    for overlapped in (False, True):
        with LLM(model_dir, async_scheduling=overlapped_setting if overlapped else False, **llm_args) as llm:
            engine = llm.engine
            engine.steps_ahead = steps_ahead
            executor = engine.executor
            launch, placeholders, in_flight = executor.launch, [], []

            def recording_launch(plan):
                placeholders.append(len(plan.placeholder_rows))
                in_flight.append(engine.num_steps_in_flight)
                return launch(plan)

            executor.launch = recording_launch
            results[overlapped] = llm.generate(prompts, params)
        # The overlapped run did plan steps ahead of their tokens, as many in flight as asked;
        # the plain one never launched.
        assert (sum(placeholders) > 0 and max(in_flight) == steps_ahead) if overlapped else (placeholders == [])
    return results[False], results[True]


def assert_same(plain, overlapped) -> None:
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in overlapped] == [o.finish_reason for o in plain]
    for a, b in zip(plain, overlapped):
        assert (a.logprobs is None) == (b.logprobs is None)
        if a.logprobs is not None:
            assert len(b.logprobs) == len(b.token_ids)
            assert [t.logprob for t in b.logprobs] == pytest.approx([t.logprob for t in a.logprobs], abs=1e-5)
            assert [t.top_token_ids for t in b.logprobs] == [t.top_token_ids for t in a.logprobs]
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        if a.prompt_logprobs is not None:
            assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
            assert [t.logprob for t in b.prompt_logprobs[1:]] == pytest.approx(
                [t.logprob for t in a.prompt_logprobs[1:]], abs=1e-5)
            assert [t.top_token_ids for t in b.prompt_logprobs[1:]] == [t.top_token_ids for t in a.prompt_logprobs[1:]]


@pytest.mark.parametrize("steps_ahead", [1, 2])
def test_greedy_outputs_equal_the_plain_engine_with_eos_stops_and_chunks(model_dir, steps_ahead) -> None:
    prompts = random_prompts(12, seed=4, lo=3, hi=80)
    rng = random.Random(1)
    params = [SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0.0) for _ in prompts]
    plain, overlapped = generate_both(model_dir, prompts, params, steps_ahead=steps_ahead, num_blocks=256,
                                      max_num_batched_tokens=40)
    assert_same(plain, overlapped)
    assert any(o.finish_reason == "length" for o in plain)


@pytest.mark.parametrize("steps_ahead", [1, 2])
def test_outputs_equal_under_preemption(model_dir, steps_ahead) -> None:
    prompts = random_prompts(8, seed=9, lo=10, hi=30)
    # Half ask for logprobs: one per token, a token on its way when its request is preempted included.
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2 if i % 2 else None)
              for i in range(len(prompts))]
    plain, overlapped = generate_both(model_dir, prompts, params, steps_ahead=steps_ahead, block_size=4,
                                      num_blocks=40, max_num_batched_tokens=64)
    assert_same(plain, overlapped)


@pytest.mark.parametrize("steps_ahead", [1, 2])
def test_seeded_sampling_and_prefix_hits_equal_the_plain_engine(model_dir, steps_ahead) -> None:
    shared = [random.Random(5).randrange(3, 1000) for _ in range(33)]
    prompts = random_prompts(6, seed=6, lo=2, hi=12, shared=shared)
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=i) for i in range(len(prompts))]
    plain, overlapped = generate_both(model_dir, prompts, params, steps_ahead=steps_ahead, block_size=8,
                                      num_blocks=128)
    assert_same(plain, overlapped)
    assert [o.num_cached_tokens for o in overlapped] == [o.num_cached_tokens for o in plain]


def test_an_engine_with_nothing_left_in_flight_after_generate(model_dir) -> None:
    with LLM(model_dir, num_blocks=64, async_scheduling=True) as llm:
        first = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        assert len(first[0].token_ids) == 5
        assert not llm.engine.has_unfinished_requests()
        again = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        assert again[0].token_ids == first[0].token_ids


def test_one_cpu_rank_in_process_is_scheduled_plainly_by_default(model_dir) -> None:
    """Its launch runs the step in the caller's thread: planning ahead would only add work."""
    with LLM(model_dir, num_blocks=16) as llm:
        assert llm.engine.async_scheduling is False


def test_tensor_parallel_ranks_get_the_samples_of_rank_0(model_dir) -> None:
    """With two ranks only rank 0 samples; it sends its samples to rank 1 for the
    placeholders, so both ranks compute the same tokens: outputs equal the plain engine's,
    seeded random sampling, preemption, penalties (counted on rank 0, the repetition penalty's prompt
    tokens kept there too) and prompt logprobs
    (their logits gathered from both ranks) included.  Ranks in other processes are
    scheduled overlapped by default."""
    prompts = random_prompts(6, seed=12, lo=3, hi=40)
    penalties = dict(logit_bias={42: 10.0}, frequency_penalty=2.0, repetition_penalty=1.3)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0 if i % 2 else 0.9, seed=i,
                             prompt_logprobs=2 if i % 3 == 1 else None, **(penalties if i % 3 == 0 else {}))
              for i in range(len(prompts))]
    plain, overlapped = generate_both(model_dir, prompts, params, overlapped_setting=None, tensor_parallel_size=2,
                                      block_size=4, num_blocks=48, max_num_batched_tokens=32)
    assert_same(plain, overlapped)


@pytest.mark.gpu
def test_graphed_steps_with_placeholders_equal_the_plain_engine_on_cuda(tmp_path) -> None:
    """On a GPU, decode steps replay CUDA graphs whose token ids are the placeholders filled
    on the device: greedy outputs equal the plain engine's (float32, the CUDA kernels)."""
    path = create_tiny_model(tmp_path, "llama", seed=3, head_dim=64)
    prompts = random_prompts(10, seed=11, lo=3, hi=60)
    penalties = dict(logit_bias={42: 10.0}, frequency_penalty=2.0, presence_penalty=0.5, repetition_penalty=1.3)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3 if i % 2 else None,
                             prompt_logprobs=2 if i % 4 == 1 else None, **(penalties if i % 3 == 0 else {}))
              for i in range(len(prompts))]
    plain, overlapped = generate_both(path, prompts, params, device="cuda", dtype="float32", num_blocks=256,
                                      max_num_seqs=16)
    assert_same(plain, overlapped)


@pytest.mark.gpu
def test_overlapped_launches_do_not_synchronise_with_the_device(tmp_path) -> None:
    """Planning step N+1 overlaps step N only if launching N+1 never waits for the device:
    torch's sync debug mode raises on any synchronising call inside a launch, whatever
    the sampling (a pageable copy of the temperatures made every sampled step wait)."""
    import torch

    path = create_tiny_model(tmp_path, "llama", seed=3, head_dim=64)
    with LLM(path, device="cuda", num_blocks=256, max_num_seqs=16, async_scheduling=True) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up: first calls may allocate
        worker = llm.engine.executor.worker
        launch, launches = worker.launch, []

        def strict_launch(plan):
            launches.append(len(plan.placeholder_rows))
            torch.cuda.set_sync_debug_mode("error")
            try:
                return launch(plan)
            finally:
                torch.cuda.set_sync_debug_mode(0)

        worker.launch = strict_launch
        prompts = random_prompts(12, seed=2, lo=3, hi=40)
        # greedy, random, top-k and top-p, seeded, penalties with biases and min_tokens, prompt logprobs,
        # a repetition penalty (its prompt's tokens marked on the device) on random sampling
        kinds = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=0.7, top_k=20, top_p=0.9),
                 dict(temperature=1.0, seed=5),
                 dict(temperature=0.0, logit_bias={42: 10.0, 3: -100.0}, frequency_penalty=2.0,
                      presence_penalty=0.5, min_tokens=4, stop_token_ids=(3,)),  # 3 never comes: 16 tokens
                 dict(temperature=0.0, prompt_logprobs=3),
                 dict(temperature=0.9, repetition_penalty=1.2, seed=7)]
        params = [SamplingParams(max_tokens=16, ignore_eos=True, **kinds[i % len(kinds)]) for i in range(len(prompts))]
        outputs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outputs] == [16] * len(prompts)
    assert sum(launches) > 0  # decode steps with placeholders were launched
