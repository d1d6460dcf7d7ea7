"""``LLM.chat``: conversations rendered as transformers renders them, then generated as any prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvserve import LLM, SamplingParams
from kvserve.worker.tiny_model import create_tiny_model
from tests.engine.hf_reference import hf_greedy, load_hf_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is a paged KV cache?"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("chat"), "llama", seed=5)


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    with LLM(model_dir, block_size=4, num_blocks=256) as engine:
        yield engine


def hf_prompt(model_dir: Path, conversation, template: str | None = None) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_conversation_is_answered_as_transformers_renders_and_generates_it(llm: LLM, model_dir: Path) -> None:
    prompt = hf_prompt(model_dir, CONVERSATION)
    assert prompt[0] == 0 and prompt.count(0) == 1  # the template's BOS, not doubled by the tokenizer
    (output,) = llm.chat(CONVERSATION, GREEDY)
    assert output.prompt_token_ids == prompt
    assert output.token_ids == hf_greedy(load_hf_model(model_dir), [prompt], GREEDY.max_tokens)[0]


def test_several_conversations_come_back_in_order(llm: LLM, model_dir: Path) -> None:
    other = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    first, second = llm.chat([CONVERSATION, other], GREEDY)
    assert first.prompt_token_ids == hf_prompt(model_dir, CONVERSATION)
    assert second.prompt_token_ids == hf_prompt(model_dir, [{"role": "user", "content": "Hello\nthere"}])
    assert second.token_ids == llm.generate([second.prompt_token_ids], GREEDY)[0].token_ids


def test_a_template_given_replaces_the_tokenizers_own(llm: LLM, model_dir: Path) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}{% if m.name %}:{{ m.name }}{% endif %}] {{ m['content'] }}" \
               "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    conversation = [{"role": "user", "content": "hi", "name": "ann"}]
    (output,) = llm.chat(conversation, GREEDY, chat_template=template)
    assert output.prompt_token_ids == hf_prompt(model_dir, conversation, template)
    assert output.prompt_token_ids != hf_prompt(model_dir, conversation)


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "messages must be a conversation"),
        ("hello", "messages must be a conversation"),
        ([{"content": "no role"}], "message 0: 'role' must be a non-empty string"),
        ([{"role": "user", "content": 3}], "message 0: 'content' must be a string or a list of text parts"),
        ([{"role": "user", "content": "hi", "tool_calls": []}], "message 0 has unknown keys \\['tool_calls'\\]"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "a content part must be"),
        ([CONVERSATION, []], "conversation 1: a conversation must have at least one message"),
    ],
)
def test_a_malformed_conversation_is_refused_naming_what_is_wrong(llm: LLM, messages, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, GREEDY)


def test_a_template_that_refuses_the_conversation_says_why(llm: LLM) -> None:
    template = "{{ raise_exception('only users may speak') }}"
    with pytest.raises(ValueError, match="the chat template refused them: only users may speak"):
        llm.chat(CONVERSATION, GREEDY, chat_template=template)


def test_a_template_that_does_not_compile_says_so_and_where(llm: LLM) -> None:
    with pytest.raises(ValueError, match="the chat template does not compile: line 2: ") as info:
        llm.chat(CONVERSATION, GREEDY, chat_template="{% for m in messages %}\n{{ m.content }")
    assert "refused them" not in str(info.value)
