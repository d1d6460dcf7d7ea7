"""vLLM's prompt forms in ``LLM.generate``: ``{"prompt": text}`` and ``{"prompt_token_ids": ids}``
(its TextPrompt and TokensPrompt), and ``GenerationOutput.prompt``, the text a prompt was given as."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.worker.tiny_model import create_tiny_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TOKEN_IDS = [0, 5, 9, 300, 42]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    path = create_tiny_model(tmp_path_factory.mktemp("prompts"), "llama", seed=4)
    with LLM(path, block_size=4, num_blocks=128) as engine:
        yield engine


def test_a_token_ids_dict_is_generated_as_its_token_ids(llm: LLM) -> None:
    # It was refused: "prompts must be a string, token ids or a list of them, got dict".
    (output,) = llm.generate({"prompt_token_ids": TOKEN_IDS}, GREEDY)
    (expected,) = llm.generate(TOKEN_IDS, GREEDY)
    assert output.prompt_token_ids == TOKEN_IDS
    assert output.token_ids == expected.token_ids


def test_a_list_of_prompt_dicts_is_generated_as_the_texts_and_token_ids_they_hold(llm: LLM) -> None:
    outputs = llm.generate([{"prompt": "Once upon a time"}, {"prompt_token_ids": TOKEN_IDS}, [7, 8]], GREEDY)
    expected = llm.generate(["Once upon a time", TOKEN_IDS, [7, 8]], GREEDY)
    assert [o.prompt_token_ids for o in outputs] == [e.prompt_token_ids for e in expected]
    assert [o.token_ids for o in outputs] == [e.token_ids for e in expected]
    assert [o.text for o in outputs] == [e.text for e in expected]


def test_the_output_prompt_is_the_text_and_none_for_token_ids(llm: LLM) -> None:
    # vLLM's RequestOutput.prompt.
    outputs = llm.generate(["Once upon a time", {"prompt": "hi"}, TOKEN_IDS, {"prompt_token_ids": TOKEN_IDS}], GREEDY)
    assert [o.prompt for o in outputs] == ["Once upon a time", "hi", None, None]
    assert outputs[1].prompt_token_ids == llm.tokenizer("hi")["input_ids"]


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ({"prompt": "hi", "multi_modal_data": {"image": None}}, "prompt dict key 'multi_modal_data' is not supported"),
        ([[5, 6], {"prompt_token_ids": [5], "token_type_ids": [0]}], "prompt dict key 'token_type_ids'"),
        ({"prompt": "hi", "prompt_token_ids": [5]}, "'prompt' or 'prompt_token_ids', not both"),
        ([{}], "'prompt' or 'prompt_token_ids', got neither"),
        ({"prompt": [5, 6]}, r"prompt dict key 'prompt' must be a string, got \[5, 6\]"),
        ({"prompt_token_ids": "hi"}, "prompt dict key 'prompt_token_ids' must be token ids, got the string 'hi'"),
        ({"prompt_token_ids": [5, 1.5]}, "prompt token ids must be integers, got 1.5"),
    ],
)
def test_prompt_dicts_with_other_keys_or_values_are_refused(llm: LLM, prompts: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY)
    assert not llm.engine.has_unfinished_requests()
