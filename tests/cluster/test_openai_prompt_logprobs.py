"""vLLM's ``prompt_logprobs: k`` on ``/v1/completions`` and ``/v1/chat/completions``: the prompt tokens'
logprobs in vLLM's shape (null first, then token id -> ``{logprob, rank, decoded_token}``), whole and
streamed, beside ``echo``, and its refusals.  (Against a real model: test_openai_api.)

The app runs in process over a real ``Frontend`` whose scheduler is a fake: it answers each request with
tokens "a" then "b"; the prompt token at position ``t`` has logprob ``-t``, and its ``k`` alternatives are
tokens ``t, t + 1, ...`` (mod 5) with logprobs ``-0.125, -0.25, ...``.
"""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from kvserve.cluster.messages import RequestSpec
from kvserve.scheduler.logprobs import TokenLogprobs
from tests.cluster import in_process_openai
from tests.cluster.in_process_openai import post_to_app
from tests.cluster.test_prompt_logprobs_openai import ALPHABET, EchoScheduler, LetterTokenizer


class ChatLetterTokenizer(LetterTokenizer):
    """A letter tokenizer whose chat template writes the messages' contents one after the other."""

    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    def apply_chat_template(self, conversation, *, chat_template, tokenize, add_generation_prompt) -> str:
        return "".join(message["content"] for message in conversation)


def fake_prompt_logprobs(num_prompt_tokens: int, num_top: int) -> list[TokenLogprobs | None]:
    tops = range(num_top)
    return [None, *(
        TokenLogprobs(-float(t), tuple((t + j) % 5 for j in tops), tuple(-0.125 * (j + 1) for j in tops))
        for t in range(1, num_prompt_tokens)
    )]


class PromptLogprobsScheduler(EchoScheduler):
    """The echo tests' fake ("a" with the prompt logprobs, then "b"), with ``k`` alternatives per prompt token."""

    def prompt_logprobs(self, spec: RequestSpec) -> list[TokenLogprobs | None] | None:
        num_top = spec.sampling_params.prompt_logprobs
        return None if num_top is None else fake_prompt_logprobs(len(spec.prompt_token_ids), num_top)


def post(path: str, body: dict) -> tuple[httpx.Response, list[RequestSpec]]:
    scheduler = PromptLogprobsScheduler()
    return post_to_app(scheduler, ChatLetterTokenizer(), path, body), scheduler.specs


def complete(**fields) -> tuple[httpx.Response, list[RequestSpec]]:
    return post("/v1/completions", {"prompt": "cax", "max_tokens": 2, **fields})


def chat(**fields) -> tuple[httpx.Response, list[RequestSpec]]:
    return post("/v1/chat/completions", {"messages": [{"role": "user", "content": "cax"}], "max_tokens": 2, **fields})


def whole(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def events(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    data = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(event) for event in data[:-1]]


def refusal(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def entry(token_id: int, logprob: float, rank: int | None) -> tuple[str, dict]:
    return str(token_id), {"logprob": logprob, "rank": rank, "decoded_token": ALPHABET[token_id]}


# Prompt "cax" (tokens 2 0 3) with prompt_logprobs: 2.  "a" (0) at position 1 is not among its top 2 (1 and 2):
# its rank is unknown; "x" (3) at position 2 is the second likeliest.
CAX_TOP_2 = [
    None,
    dict([entry(0, -1.0, None), entry(1, -0.125, 1), entry(2, -0.25, 2)]),
    dict([entry(3, -2.0, 2), entry(2, -0.125, 1)]),
]


# -- whole -----------------------------------------------------------------------------------------


def test_a_completion_carries_its_prompts_logprobs_in_vllms_shape():
    response, [spec] = complete(prompt_logprobs=2)

    [choice] = whole(response)["choices"]
    assert choice["prompt_logprobs"] == CAX_TOP_2
    assert choice["logprobs"] is None
    # The text prompt was tokenized once, to name its tokens, and sent as ids.
    assert spec.prompt_token_ids == [2, 0, 3]
    assert spec.sampling_params.prompt_logprobs == 2


def test_the_prompt_token_comes_first_then_the_likeliest_in_order():
    response, _ = complete(prompt_logprobs=2)

    entries = whole(response)["choices"][0]["prompt_logprobs"]
    assert [list(e) for e in entries[1:]] == [["0", "1", "2"], ["3", "2"]]


def test_zero_gives_each_prompt_tokens_own_logprob_only():
    response, _ = complete(prompt_logprobs=0, prompt=[2, 0, 3])

    assert whole(response)["choices"][0]["prompt_logprobs"] == [
        None, dict([entry(0, -1.0, None)]), dict([entry(3, -2.0, None)])
    ]


def test_each_of_n_choices_carries_them():
    response, specs = complete(prompt_logprobs=2, n=2)

    assert [c["prompt_logprobs"] for c in whole(response)["choices"]] == [CAX_TOP_2, CAX_TOP_2]
    assert [spec.sampling_params.prompt_logprobs for spec in specs] == [2, 2]


def test_a_request_that_does_not_ask_has_no_such_field():
    completion = whole(complete()[0])
    answer = whole(chat()[0])

    assert "prompt_logprobs" not in completion["choices"][0]
    assert "prompt_logprobs" not in answer
    assert "prompt_logprobs" not in answer["choices"][0]


def test_a_chat_answer_carries_them_once_beside_its_choices():
    response, [spec] = chat(prompt_logprobs=2)

    answer = whole(response)
    assert answer["prompt_logprobs"] == CAX_TOP_2
    assert "prompt_logprobs" not in answer["choices"][0]
    assert spec.prompt_token_ids == [2, 0, 3]


# -- beside echo -----------------------------------------------------------------------------------


def test_echo_keeps_its_logprobs_alternatives_when_prompt_logprobs_asks_more():
    response, [spec] = complete(echo=True, logprobs=1, prompt_logprobs=2)

    [choice] = whole(response)["choices"]
    assert spec.sampling_params.prompt_logprobs == 2  # one ask serves both
    assert choice["logprobs"]["top_logprobs"][:3] == [None, {"b": -0.125, "a": -1.0}, {"c": -0.125, "x": -2.0}]
    assert choice["prompt_logprobs"] == CAX_TOP_2


def test_prompt_logprobs_keep_their_k_when_echo_asks_more():
    response, [spec] = complete(echo=True, logprobs=2, prompt_logprobs=0)

    [choice] = whole(response)["choices"]
    assert spec.sampling_params.prompt_logprobs == 2
    assert choice["logprobs"]["top_logprobs"][1] == {"b": -0.125, "c": -0.25, "a": -1.0}
    assert choice["prompt_logprobs"] == [None, dict([entry(0, -1.0, None)]), dict([entry(3, -2.0, 2)])]


# -- streamed --------------------------------------------------------------------------------------


def test_a_streamed_completion_carries_them_in_each_choices_first_chunk_only():
    response, _ = complete(prompt_logprobs=2, n=2, stream=True)

    chunks = [chunk["choices"][0] for chunk in events(response)]
    for index in (0, 1):
        first, *rest = [c for c in chunks if c["index"] == index]
        assert (first["text"], first["prompt_logprobs"]) == ("a", CAX_TOP_2)
        assert rest and all("prompt_logprobs" not in c for c in rest)


def test_a_streamed_chat_answer_carries_them_in_each_choices_first_chunk_only():
    response, _ = chat(prompt_logprobs=2, n=2, stream=True)

    chunks = events(response)
    for index in (0, 1):
        first, *rest = [c for c in chunks if c["choices"][0]["index"] == index]
        assert first["prompt_logprobs"] == CAX_TOP_2
        assert rest and all("prompt_logprobs" not in c for c in rest)


# -- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("value", [21, -1, 2**70])
def test_a_count_out_of_range_is_a_400_naming_prompt_logprobs(path, value):
    response, specs = (complete if path == "/v1/completions" else chat)(prompt_logprobs=value)

    error = refusal(response)
    assert error["param"] == "prompt_logprobs"
    assert error["message"] == f"prompt_logprobs: must be an integer in [0, 20], got {value}"
    assert specs == []


@pytest.mark.parametrize("value", ["2", True, 1.5, [2]])
def test_a_value_that_is_not_an_integer_is_a_400_naming_prompt_logprobs(value):
    error = refusal(complete(prompt_logprobs=value)[0])

    assert error["param"] == "prompt_logprobs"
    assert error["message"].startswith("prompt_logprobs: ")


def test_null_asks_for_none():
    response, [spec] = complete(prompt_logprobs=None)

    assert "prompt_logprobs" not in whole(response)["choices"][0]
    assert spec.sampling_params.prompt_logprobs is None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_simulated_server_refuses_them_saying_why(monkeypatch, path):
    simulated = dataclasses.replace(in_process_openai.MODEL_INFO, simulated=True)
    monkeypatch.setattr(in_process_openai, "MODEL_INFO", simulated)

    response, _ = (complete if path == "/v1/completions" else chat)(prompt_logprobs=1)

    error = refusal(response)
    assert error["param"] == "prompt_logprobs"
    assert error["message"] == (
        "prompt_logprobs: this server's replicas are simulated (no model), so it has no log-probabilities"
    )
