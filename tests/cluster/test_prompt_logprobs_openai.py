"""``echo: true`` on ``/v1/completions``: the prompt's text in front of each choice's, and, with
``logprobs: k``, the prompt tokens' logprobs in front of the completion's (null for the first), whole and
streamed, as OpenAI's legacy completions API gives them.

The app runs in process over a real ``Frontend`` whose scheduler is the fake of test_frontend_streaming:
it answers each request with tokens "a" then "b", the prompt token at position ``t`` having logprob ``-t``.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvserve.cluster.messages import RequestDelta, RequestSpec
from kvserve.scheduler.logprobs import TokenLogprobs
from tests.cluster.in_process_openai import post_to_app
from tests.cluster.test_frontend_streaming import FakeScheduler

ALPHABET = "abcxy"
OUTPUT = [0, 1]  # "a", "b"


class LetterTokenizer:
    """Token ``i`` is the ``i``-th letter of ``ALPHABET``, each way."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ALPHABET.index(letter) for letter in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(ALPHABET[i] for i in ids)


def prompt_logprobs(num_prompt_tokens: int) -> list[TokenLogprobs | None]:
    """The fake's prompt logprobs: ``-t`` at position ``t``, one alternative (token ``t % 5``, -0.125)."""
    return [None, *(TokenLogprobs(-float(t), (t % 5,), (-0.125,)) for t in range(1, num_prompt_tokens))]


OUTPUT_LOGPROBS = [TokenLogprobs(-0.5, (0,), (-0.5,)), TokenLogprobs(-0.25, (1,), (-0.25,))]


class EchoScheduler(FakeScheduler):
    """Records the specs it is given; each request gets "a" (with its prompt logprobs, if it asked) at
    once, then "b" and its end a little later (two messages, two chunks)."""

    def __init__(self) -> None:
        super().__init__()
        self.specs: list[RequestSpec] = []

    async def _add_requests(self, specs: list[RequestSpec]) -> list[int | Exception]:
        self.specs.extend(specs)
        results = await super()._add_requests(specs)
        loop = asyncio.get_running_loop()
        for spec in specs:
            params = spec.sampling_params
            logprobs = OUTPUT_LOGPROBS if params.logprobs is not None else None
            prompt = self.prompt_logprobs(spec)
            self.emit(RequestDelta(
                spec.req_id, OUTPUT[:1], replica=0, logprobs=logprobs and logprobs[:1], prompt_logprobs=prompt
            ))
            last = RequestDelta(
                spec.req_id, OUTPUT[1:], finish_reason="length", num_prompt_tokens=len(spec.prompt_token_ids),
                num_output_tokens=2, replica=0, logprobs=logprobs and logprobs[1:],
            )
            loop.call_later(0.05, self.emit, last)
        return results

    def prompt_logprobs(self, spec: RequestSpec) -> list[TokenLogprobs | None] | None:
        """What the fake answers ``spec`` with for its prompt tokens' logprobs, if it asked."""
        if spec.sampling_params.prompt_logprobs is None:
            return None
        return prompt_logprobs(len(spec.prompt_token_ids))


def post(path: str, body: dict) -> tuple[httpx.Response, list[RequestSpec]]:
    """``body`` POSTed to ``path`` (``model`` added), and the specs the scheduler was given for it."""
    scheduler = EchoScheduler()
    return post_to_app(scheduler, LetterTokenizer(), path, body), scheduler.specs


def complete(**fields) -> tuple[httpx.Response, list[RequestSpec]]:
    return post("/v1/completions", {"prompt": "cax", "max_tokens": 2, "echo": True, **fields})


def choices(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    return response.json()["choices"]


def chunks(response: httpx.Response) -> list[dict]:
    """The choices' chunks of a stream, in order."""
    assert response.status_code == 200, response.text
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [choice for event in events[:-1] for choice in json.loads(event)["choices"]]


def refusal(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


# The legacy logprobs of prompt "cax" (tokens c a x) and completion "ab", with logprobs: 1.
ECHOED_LOGPROBS = {
    "tokens": ["c", "a", "x", "a", "b"],
    "token_logprobs": [None, -1.0, -2.0, -0.5, -0.25],
    "top_logprobs": [None, {"b": -0.125, "a": -1.0}, {"c": -0.125, "x": -2.0}, {"a": -0.5}, {"b": -0.25}],
    "text_offset": [0, 1, 2, 3, 4],
}


# -- whole -----------------------------------------------------------------------------------------


def test_echo_puts_the_prompts_text_in_front_of_the_completions():
    response, [spec] = complete()

    [choice] = choices(response)
    assert (choice["text"], choice["logprobs"]) == ("caxab", None)
    assert spec.sampling_params.prompt_logprobs is None  # nothing asks for them


def test_echo_with_logprobs_gives_the_prompt_tokens_logprobs_first_null_for_the_first():
    response, [spec] = complete(logprobs=1)

    [choice] = choices(response)
    assert choice["text"] == "caxab"
    assert choice["logprobs"] == ECHOED_LOGPROBS
    # The text prompt was tokenized once, for the logprobs' tokens, and sent as ids.
    assert spec.prompt_token_ids == [2, 0, 3]
    assert (spec.sampling_params.prompt_logprobs, spec.sampling_params.logprobs) == (1, 1)


def test_a_token_id_prompt_is_echoed_as_its_decoded_text():
    response, [spec] = complete(prompt=[2, 0, 3], logprobs=1)

    [choice] = choices(response)
    assert (choice["text"], choice["logprobs"]) == ("caxab", ECHOED_LOGPROBS)
    assert spec.prompt_token_ids == [2, 0, 3]


def test_a_token_id_prompt_without_logprobs_is_echoed_too():
    response, _ = complete(prompt=[[4, 1]])

    assert choices(response)[0]["text"] == "ybab"


def test_each_of_n_choices_echoes_the_prompt():
    response, specs = complete(n=2, logprobs=1)

    assert [(c["index"], c["text"], c["logprobs"]) for c in choices(response)] == [
        (0, "caxab", ECHOED_LOGPROBS), (1, "caxab", ECHOED_LOGPROBS)
    ]
    assert [spec.sampling_params.prompt_logprobs for spec in specs] == [1, 1]
    assert response.json()["usage"]["prompt_tokens"] == 3


def test_a_one_token_prompt_has_one_null_entry():
    response, _ = complete(prompt="c", logprobs=0)

    logprobs = choices(response)[0]["logprobs"]
    assert logprobs["tokens"] == ["c", "a", "b"]
    assert logprobs["token_logprobs"] == [None, -0.5, -0.25]
    assert logprobs["top_logprobs"] == [None, {"a": -0.5}, {"b": -0.25}]


def test_without_echo_nothing_changes():
    response, [spec] = complete(echo=False, logprobs=1)

    [choice] = choices(response)
    assert choice["text"] == "ab"
    assert choice["logprobs"]["tokens"] == ["a", "b"]
    assert spec.sampling_params.prompt_logprobs is None


def test_a_stop_string_cuts_the_completions_logprobs_and_leaves_the_prompts():
    response, _ = complete(logprobs=1, stop="b")

    [choice] = choices(response)
    assert (choice["text"], choice["finish_reason"]) == ("caxa", "stop")
    assert choice["logprobs"] == {key: value[:4] for key, value in ECHOED_LOGPROBS.items()}


# -- streamed --------------------------------------------------------------------------------------


def test_a_stream_echoes_the_prompt_and_its_logprobs_in_the_first_chunk():
    response, _ = complete(stream=True, logprobs=1)

    first, second = chunks(response)
    assert first["text"] == "caxa"
    assert first["logprobs"] == {key: value[:4] for key, value in ECHOED_LOGPROBS.items()}
    assert second["text"] == "b"
    assert second["logprobs"] == {key: value[4:] for key, value in ECHOED_LOGPROBS.items()}
    assert second["finish_reason"] == "length"


def test_a_stream_without_logprobs_echoes_the_text_only():
    response, _ = complete(stream=True, prompt=[2, 0, 3])

    assert [(c["text"], c["logprobs"]) for c in chunks(response)] == [("caxa", None), ("b", None)]


def test_each_streamed_choice_echoes_in_its_own_first_chunk():
    response, _ = complete(stream=True, n=2, logprobs=1)

    by_choice = {index: [c for c in chunks(response) if c["index"] == index] for index in (0, 1)}
    for index in (0, 1):
        texts = [c["text"] for c in by_choice[index]]
        assert texts == ["caxa", "b"], index
        assert by_choice[index][0]["logprobs"]["token_logprobs"] == [None, -1.0, -2.0, -0.5]


# -- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, field", [({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of")])
def test_echo_with_suffix_or_best_of_is_still_refused(fields, field):
    error = refusal(complete(**fields)[0])

    assert error["param"] == field
    assert error["message"].startswith(f"{field}: kvserve does not support this field yet")


def test_echo_with_logprobs_out_of_range_is_refused_naming_logprobs():
    error = refusal(complete(logprobs=21)[0])

    assert error["param"] == "logprobs"
    assert error["message"] == "logprobs must be an integer in [0, 20], got 21"


# -- a batch of prompts ----------------------------------------------------------------------------


def test_each_prompt_of_a_batch_echoes_itself_with_its_own_logprobs_and_counts_once():
    # lm-evaluation-harness's local-completions with batch_size > 1 sends its prompts so.
    response, specs = complete(prompt=["cax", "c"], logprobs=1, n=2)

    one_token_prompt = {"tokens": ["c", "a", "b"], "token_logprobs": [None, -0.5, -0.25],
                        "top_logprobs": [None, {"a": -0.5}, {"b": -0.25}], "text_offset": [0, 1, 2]}
    assert [(c["index"], c["text"], c["logprobs"]) for c in choices(response)] == [
        (0, "caxab", ECHOED_LOGPROBS), (1, "caxab", ECHOED_LOGPROBS),
        (2, "cab", one_token_prompt), (3, "cab", one_token_prompt),
    ]
    assert [spec.prompt_token_ids for spec in specs] == [[2, 0, 3], [2, 0, 3], [2], [2]]
    assert len({spec.req_id for spec in specs}) == 4
    usage = response.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (3 + 1, 4 * 2)  # each prompt once


def test_each_streamed_choice_of_a_batch_echoes_its_own_prompt_in_its_first_chunk():
    response, _ = complete(stream=True, prompt=[[2, 0, 3], [4, 1]], stream_options={"include_usage": True})

    by_choice = {index: [c["text"] for c in chunks(response) if c["index"] == index] for index in (0, 1)}
    assert by_choice == {0: ["caxa", "b"], 1: ["yba", "b"]}
    usage = json.loads(response.text.split("data: ")[-2])["usage"]
    assert usage["prompt_tokens"] == 3 + 2


def test_a_batch_whose_choices_could_never_run_at_once_is_refused_naming_the_prompt():
    error = refusal(complete(prompt=["ca", "xa", "cc"], n=3)[0])  # 9 requests; the app runs 8 at a time

    assert error["param"] == "prompt"
    assert error["message"] == (
        "prompt: a batch of 3 prompts with n=3 is 9 requests; this server runs at most 8 at a time (send smaller batches)"
    )
