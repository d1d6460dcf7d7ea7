"""``SamplingParams.n`` in process, as vLLM's ``LLM`` has it: ``n`` completions of a prompt in
``output.outputs``, completion ``i`` seeded with ``seed + i`` (as the servers' OpenAI API seeds its
choices), the flat fields the first completion's."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve import LLM, CompletionOutput, SamplingParams
from kvserve.scheduler.request import Request
from kvserve.worker.tiny_model import create_tiny_model
from tests.engine.test_llm_parity import random_prompts


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    path = create_tiny_model(tmp_path_factory.mktemp("m"), "llama", seed=1)
    with LLM(path, block_size=4, num_blocks=256, max_num_batched_tokens=32, seed=123) as engine:
        yield engine


SEEDED = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True, logprobs=0)


def test_n_seeded_completions_are_the_completions_of_seed_plus_i_one_by_one(llm: LLM) -> None:
    prompt = random_prompts(1, seed=8)[0]
    (output,) = llm.generate([prompt], dataclasses.replace(SEEDED, n=3))
    one_by_one = [llm.generate([prompt], dataclasses.replace(SEEDED, seed=42 + i))[0] for i in range(3)]

    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert [c.token_ids for c in output.outputs] == [o.token_ids for o in one_by_one]
    assert [c.text for c in output.outputs] == [o.text for o in one_by_one]
    # Logprobs to float32's rounding: a batch of three rows computes them apart from a batch of one.
    got = [[t.logprob for t in c.logprobs] for c in output.outputs]
    assert got == [pytest.approx([t.logprob for t in o.logprobs], abs=1e-4) for o in one_by_one]
    assert len({tuple(c.token_ids) for c in output.outputs}) == 3  # sampled apart
    first = output.outputs[0]
    assert (output.token_ids, output.text, output.finish_reason, output.logprobs) == (
        first.token_ids, first.text, first.finish_reason, first.logprobs)
    assert output.prompt_token_ids == prompt


def test_each_prompt_of_a_batch_gets_its_own_n_in_prompt_order(llm: LLM) -> None:
    prompts = random_prompts(3, seed=9)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, [dataclasses.replace(greedy, n=2), greedy, dataclasses.replace(greedy, n=4)])
    alone = llm.generate(prompts, greedy)

    assert [len(o.outputs) for o in outputs] == [2, 1, 4]
    for output, reference in zip(outputs, alone):
        assert output.prompt_token_ids == reference.prompt_token_ids
        # Greedy completions of one prompt are all the same, and the prompt's greedy tokens.
        assert [c.token_ids for c in output.outputs] == [reference.token_ids] * len(output.outputs)
        assert all(c.finish_reason == "length" for c in output.outputs)


def test_one_completion_is_the_flat_result_as_vllm_code_reads_it(llm: LLM) -> None:
    (output,) = llm.generate(["a tiny prompt"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert output.outputs == [CompletionOutput(0, output.token_ids, output.text, output.finish_reason, None)]
    assert output.outputs[0].text == output.text  # `output.outputs[0].text`, as written for vLLM


@pytest.mark.parametrize(("n", "message"), [(0, "n must be at least 1, got 0"), (-2, "n must be at least 1"),
                                            (1.5, "n must be an integer, got 1.5"), (True, "n must be an integer")])
def test_an_n_that_is_not_a_positive_integer_is_refused_naming_it(n: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(n=n)


def test_a_request_of_the_scheduler_runs_one_sequence_and_refuses_n() -> None:
    # The servers fan n out themselves (one request per choice): a request with n > 1 would be
    # served as one completion without a word.
    with pytest.raises(ValueError, match="n=2: a request runs one sequence"):
        Request("r", [1, 2, 3], SamplingParams(n=2))
