"""``SamplingParams.stop`` in process: ``LLM`` ends a request at the token whose text completes a
stop string, as the servers do, against the tokenizer's own decoding of the full output."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.worker.tiny_model import create_tiny_model

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("stop"), "llama", seed=11)


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "async"])
def llm(model_dir: Path, request: pytest.FixtureRequest):
    with LLM(model_dir, block_size=4, num_blocks=512, async_scheduling=request.param) as engine:
        yield engine


def greedy(**extra) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **extra)


def expected_stop(llm: LLM, token_ids: list[int], stop: str, min_tokens: int = 0) -> tuple[list[int], str] | None:
    """Where the tokenizer's decoding of ``token_ids`` first completes ``stop`` past ``min_tokens``
    tokens: the tokens up to that one and the text before ``stop``; ``None`` if it never does."""
    protected = len(llm.tokenizer.decode(token_ids[:min_tokens], skip_special_tokens=True))
    for k in range(1, len(token_ids) + 1):
        text = llm.tokenizer.decode(token_ids[:k], skip_special_tokens=True)
        start = text.find(stop, max(0, protected - len(stop) + 1))
        if start >= 0:
            return token_ids[:k], text[:start]
    return None


def a_stop_string_in(llm: LLM, prompt: list[int]) -> tuple[list[int], str]:
    """The greedy output of ``prompt`` and a stop string its text completes past its middle."""
    (full,) = llm.generate([prompt], greedy())
    middle = llm.tokenizer.decode(full.token_ids[: MAX_TOKENS // 2], skip_special_tokens=True)
    text = full.text
    stop = text[len(middle): len(middle) + 3].strip() or text[len(middle):][:3]
    assert stop, f"the output's text {text!r} has nothing past its middle"
    return full.token_ids, stop


def test_a_request_ends_at_the_token_that_completes_its_stop_string(llm: LLM) -> None:
    prompt = [5, 17, 23, 42, 8, 99]
    token_ids, stop = a_stop_string_in(llm, prompt)
    want_tokens, want_text = expected_stop(llm, token_ids, stop)
    (output,) = llm.generate([prompt], greedy(stop=[stop], logprobs=0))
    assert output.finish_reason == "stop"
    assert output.token_ids == want_tokens and len(want_tokens) < MAX_TOKENS
    assert output.text == want_text and stop not in output.text
    assert len(output.logprobs) == len(output.token_ids)


def test_stop_strings_leave_the_other_requests_of_the_call_as_they_were(llm: LLM) -> None:
    prompts = [[5, 17, 23, 42, 8, 99], [7, 7, 3, 11], [300, 200, 100]]
    alone = llm.generate(prompts, greedy())
    token_ids, stop = a_stop_string_in(llm, prompts[0])
    outputs = llm.generate(prompts, [greedy(stop=stop), greedy(), greedy(stop=["never in this text \u2603"])])
    assert outputs[0].token_ids == expected_stop(llm, token_ids, stop)[0]
    assert [o.token_ids for o in outputs[1:]] == [o.token_ids for o in alone[1:]]
    assert outputs[2].finish_reason == "length" and outputs[2].text == alone[2].text


def test_a_stop_string_within_min_tokens_does_not_stop(llm: LLM) -> None:
    prompt = [9, 18, 27, 36, 45]
    (full,) = llm.generate([prompt], greedy())
    first = llm.tokenizer.decode(full.token_ids[:3], skip_special_tokens=True).strip()[:2]
    assert first, "the first tokens have no text"
    (early,) = llm.generate([prompt], greedy(stop=first))
    (held,) = llm.generate([prompt], greedy(stop=first, min_tokens=8))
    assert len(early.token_ids) <= 3 and early.finish_reason == "stop"
    expected = expected_stop(llm, full.token_ids, first, min_tokens=8)
    if expected is None:
        assert held.token_ids == full.token_ids and held.finish_reason == "length"
    else:
        assert (held.token_ids, held.text) == expected and len(held.token_ids) > 8


def test_bad_stop_strings_are_refused_by_sampling_params() -> None:
    with pytest.raises(ValueError, match="stop: a stop string is empty"):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(ValueError, match="stop must be a string or a list of strings"):
        SamplingParams(stop=[3])


def test_stop_strings_on_a_model_without_a_tokenizer_are_refused_before_anything_runs(tmp_path: Path) -> None:
    model_dir = create_tiny_model(tmp_path / "model", "llama", seed=11)
    (model_dir / "tokenizer.json").unlink()
    with LLM(model_dir, block_size=4, num_blocks=64) as llm:
        assert llm.tokenizer is None
        with pytest.raises(ValueError, match="stop strings need the detokenized text"):
            llm.generate([[5, 6, 7], [8, 9]], [greedy(), greedy(stop="x")])
        assert not llm.engine.has_unfinished_requests()
        (output,) = llm.generate([[5, 6, 7]], greedy())
        assert len(output.token_ids) == MAX_TOKENS
