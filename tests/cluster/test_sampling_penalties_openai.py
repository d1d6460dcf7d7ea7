"""Penalties (OpenAI's and vLLM's ``repetition_penalty``), ``logit_bias`` and ``min_tokens`` through the
OpenAI-compatible API: what a JSON body becomes
(the ``SamplingParams`` its request is scheduled with) and what is a 400 naming the field.

The app runs in process over a real ``Frontend`` whose scheduler is the fake of test_frontend_streaming,
which records what it is given and finishes each request at once.
"""

from __future__ import annotations


import httpx
import pytest

from kvserve.cluster.messages import RequestDelta, RequestSpec
from kvserve.scheduler.sampling_params import SamplingParams
from tests.cluster.in_process_openai import post_to_app
from tests.cluster.test_frontend_streaming import MODEL_INFO, FakeScheduler

VOCAB_SIZE = MODEL_INFO.vocab_size
MESSAGES = [{"role": "user", "content": "hi"}]


class RecordingScheduler(FakeScheduler):
    """Records the specs it is given and finishes each request with one token."""

    def __init__(self) -> None:
        super().__init__()
        self.specs: list[RequestSpec] = []

    async def _add_requests(self, specs: list[RequestSpec]) -> list[int | Exception]:
        self.specs.extend(specs)
        results = await super()._add_requests(specs)
        self.emit(*(RequestDelta(spec.req_id, [7], finish_reason="length", replica=0) for spec in specs))
        return results


class FixedTokenizer:
    """Every text (a rendered conversation too) is tokens 5, 6; every token decodes to "w"."""

    chat_template = "{{ messages }}"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [5, 6]}

    def apply_chat_template(self, conversation: list, **options: object) -> str:
        return "rendered"

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "w" * len(ids)


def post(path: str, body: dict) -> tuple[httpx.Response, list[RequestSpec]]:
    """``body`` POSTed to ``path`` (``model`` added), and the specs the scheduler was given for it."""
    scheduler = RecordingScheduler()
    return post_to_app(scheduler, FixedTokenizer(), path, body), scheduler.specs


def complete(**fields) -> tuple[httpx.Response, list[RequestSpec]]:
    return post("/v1/completions", {"prompt": "hello", "max_tokens": 8, **fields})


def chat(**fields) -> tuple[httpx.Response, list[RequestSpec]]:
    return post("/v1/chat/completions", {"messages": MESSAGES, **fields})


def refusal(response: httpx.Response) -> dict:
    """The OpenAI error of a 400."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


# -- what a body becomes -------------------------------------------------------------------------


FIELDS = {"presence_penalty": 0.5, "frequency_penalty": -1.25, "logit_bias": {"7": -100, "3": 2.5}, "min_tokens": 4,
          "repetition_penalty": 1.2}
EXPECTED = dict(presence_penalty=0.5, frequency_penalty=-1.25, logit_bias=((3, 2.5), (7, -100.0)), min_tokens=4,
                repetition_penalty=1.2)


def test_a_completion_samples_with_the_bodys_penalties_biases_and_min_tokens():
    response, [spec] = complete(**FIELDS)

    assert response.status_code == 200, response.text
    assert spec.sampling_params == SamplingParams(max_tokens=8, **EXPECTED)


def test_a_chat_completion_samples_with_them_too():
    response, [spec] = chat(max_completion_tokens=6, **FIELDS)

    assert response.status_code == 200, response.text
    assert spec.sampling_params == SamplingParams(max_tokens=6, **EXPECTED)


def test_each_of_n_choices_samples_with_them():
    response, specs = complete(n=2, **FIELDS)

    assert response.status_code == 200, response.text
    assert [spec.sampling_params for spec in specs] == [SamplingParams(max_tokens=8, **EXPECTED)] * 2


def test_nulls_and_absent_fields_leave_the_logits_alone():
    nulls = {"presence_penalty": None, "frequency_penalty": None, "logit_bias": None, "min_tokens": None,
             "repetition_penalty": None}

    for response, [spec] in (complete(), complete(**nulls), complete(logit_bias={})):
        assert response.status_code == 200, response.text
        assert spec.sampling_params == SamplingParams(max_tokens=8)


# -- what is refused ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be in [-2, 2], got -3.0"),
        ({"presence_penalty": "0.5"}, "presence_penalty", "presence_penalty: Input should be a valid number"),
        ({"logit_bias": {"abc": 1}}, "logit_bias",
         "logit_bias: keys must be token ids written as decimal strings (such as \"50256\"), got 'abc'"),
        ({"logit_bias": {"-1": 1}}, "logit_bias",
         "logit_bias: keys must be token ids written as decimal strings (such as \"50256\"), got '-1'"),
        ({"logit_bias": {" 5": 1}}, "logit_bias",
         "logit_bias: keys must be token ids written as decimal strings (such as \"50256\"), got ' 5'"),
        ({"logit_bias": {"1" * 30: 1}}, "logit_bias", "logit_bias: the key 111111111111111111111111... is too long "
         "for a token id"),
        ({"logit_bias": {str(VOCAB_SIZE): 1}}, "logit_bias",
         f"logit_bias: token id {VOCAB_SIZE} is outside the vocabulary [0, {VOCAB_SIZE})"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "logit_bias[5] must be in [-100, 100], got 101.0"),
        ({"logit_bias": {"5": "high"}}, "logit_bias", "logit_bias.5: Input should be a valid number"),
        ({"logit_bias": {"5": True}}, "logit_bias", "logit_bias.5: Input should be a valid number"),
        ({"logit_bias": [[5, 1]]}, "logit_bias", "logit_bias: Input should be a valid dictionary"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias",
         "logit_bias may name at most 300 tokens, got 301"),
        ({"min_tokens": 9}, "min_tokens", "min_tokens must be in [0, max_tokens=8], got 9"),
        ({"min_tokens": -1}, "min_tokens", "min_tokens must be in [0, max_tokens=8], got -1"),
        ({"min_tokens": 2.0}, "min_tokens", "min_tokens: Input should be a valid integer"),
        ({"min_tokens": 2**40}, "min_tokens", "min_tokens: Value out of range: 1099511627776"),
        ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be finite and > 0, got 0.0"),
        ({"repetition_penalty": -1.1}, "repetition_penalty", "repetition_penalty must be finite and > 0, got -1.1"),
        ({"repetition_penalty": 1e400}, "repetition_penalty", "repetition_penalty must be finite and > 0, got inf"),
        ({"repetition_penalty": "1.2"}, "repetition_penalty", "repetition_penalty: Input should be a valid number"),
        ({"repetition_penalty": True}, "repetition_penalty", "repetition_penalty: Input should be a valid number"),
    ],
)
def test_a_bad_value_is_a_400_naming_its_field(fields, param, message):
    response, specs = complete(**fields)

    error = refusal(response)
    assert (error["param"], error["message"]) == (param, message)
    assert not specs


def test_a_bad_repetition_penalty_is_a_400_on_chat_too():
    error = refusal(chat(repetition_penalty=-2)[0])

    assert (error["param"], error["message"]) == ("repetition_penalty", "repetition_penalty must be finite and > 0, "
                                                  "got -2.0")


def test_min_tokens_over_max_completion_tokens_is_refused_in_the_requests_own_words():
    error = refusal(chat(max_completion_tokens=3, min_tokens=4)[0])

    assert (error["param"], error["message"]) == (
        "min_tokens", "min_tokens must be in [0, max_completion_tokens=3], got 4"
    )


def test_penalties_are_no_longer_refused_as_unsupported():
    # They were accepted at 0 only ("kvserve does not support this field yet").
    response, [spec] = chat(max_tokens=2, presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"5": 1})

    assert response.status_code == 200, response.text
    assert spec.sampling_params.adjusts_logits
