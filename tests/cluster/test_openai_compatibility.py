"""What an OpenAI client may send and what it gets back, as OpenAI's API defines it: text that is not UTF-8,
nulls, strict types, unsupported fields, default output limits, prompt limits, stop strings, logprobs and echo.

The server: ``openai_served`` (one replica of the tiny model, its gRPC and HTTP servers).
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from kvserve.cluster.config import ServerConfig
from kvserve.cluster.frontend import InvalidRequestError
from kvserve.cluster.http_server import start_http_server
from kvserve.cluster.openai_errors import FieldNames, frontend_error_response
from tests.cluster.openai_served import (  # noqa: F401 - fixtures
    MAX_PROMPT_BYTES,
    TIMEOUT_S,
    Served,
    served,
)
from tests.engine.hf_reference import hf_log_softmax, load_hf_model

MESSAGES = [{"role": "user", "content": "hello there"}]
MAX_MODEL_LEN = 2048  # the tiny model's


def post(served: Served, path: str, body: dict) -> httpx.Response:
    """``body`` sent as JSON with ASCII escapes (``\\ud800`` for a lone surrogate), as JSON encoders do."""
    return httpx.post(
        f"{served.base_url}{path}", content=json.dumps(body), headers={"content-type": "application/json"},
        timeout=TIMEOUT_S,
    )


def complete(served: Served, **fields) -> httpx.Response:
    return post(served, "/v1/completions", {"model": served.model, "prompt": "hello", "max_tokens": 2, **fields})


def chat(served: Served, **fields) -> httpx.Response:
    return post(served, "/v1/chat/completions", {"model": served.model, "messages": MESSAGES, **fields})


def refusal(response: httpx.Response) -> dict:
    """The OpenAI error of a 400."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


# -- text that is not UTF-8 ----------------------------------------------------


@pytest.mark.parametrize(
    "path, fields, field",
    [
        ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
        ("/v1/completions", {"prompt": ["\ud800"]}, "prompt.0"),
        ("/v1/completions", {"stop": "\udc00"}, "stop"),
        ("/v1/completions", {"stop": ["ok", "x\udc00"]}, "stop.1"),
        ("/v1/completions", {"cache_salt": "\udc00"}, "cache_salt"),
        ("/v1/completions", {"user": "\udc00"}, "user"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
         "messages.0.content.0.text"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]},
         "messages.0.name"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_its_field(served: Served, path, fields, field):
    body = {"model": served.model, "prompt": "hello", "messages": MESSAGES, "max_tokens": 2, **fields}
    body.pop("messages" if path == "/v1/completions" else "prompt")

    error = refusal(post(served, path, body))

    # The surrogate is named by its escape: the error body is UTF-8 JSON too.
    assert error["message"].startswith(f"{field}: not valid UTF-8 text (it holds the lone UTF-16 surrogate \\u")
    assert error["param"] == field.split(".")[0]


def test_a_surrogate_in_a_key_is_a_400_that_says_so(served: Served):
    error = refusal(complete(served, **{"foo\ud800": 1}))

    assert error["message"] == (
        "a key of the request body is not valid UTF-8 text (it holds the lone UTF-16 surrogate \\ud800)"
    )


def test_a_body_that_is_not_utf8_is_a_400(served: Served):
    response = httpx.post(
        f"{served.base_url}/v1/completions", content=b'{"model": "tiny-llama", "prompt": "\xff"}',
        headers={"content-type": "application/json"}, timeout=TIMEOUT_S,
    )

    assert refusal(response)["message"] == "the request body is not valid UTF-8"


def test_an_escaped_surrogate_pair_is_one_character_and_served(served: Served):
    response = complete(served, prompt="smile \U0001f600")  # json.dumps writes "\ud83d\ude00"

    assert response.status_code == 200, response.text


# -- null is the default -------------------------------------------------------


@pytest.mark.parametrize(
    "field", ["n", "stream", "echo", "presence_penalty", "frequency_penalty", "logprobs", "best_of", "suffix",
              "logit_bias", "stream_options", "seed", "stop", "temperature", "top_p", "user", "max_tokens"],
)
def test_a_completion_field_sent_as_null_takes_its_default(served: Served, field):
    response = complete(served, **{field: None})

    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"] is None


def test_max_tokens_sent_as_null_is_the_legacy_16_not_the_rest_of_the_context(served: Served):
    # As a None it would pass validation and mean "the rest of the context": a 200 either way.
    response = complete(served, max_tokens=None, temperature=0, ignore_eos=True)

    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize(
    "field", ["n", "stream", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "max_tokens",
              "max_completion_tokens", "response_format", "tools", "tool_choice", "store", "metadata"],
)
def test_a_chat_field_sent_as_null_takes_its_default(served: Served, field):
    body = {"max_tokens": 2, field: None} if field != "max_tokens" else {"max_completion_tokens": 2, field: None}

    response = chat(served, **body)

    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


# -- strict types --------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"stream": "yes"}, "stream"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"logprobs": True}, "logprobs"),
        ({"n": 1.0}, "n"),
        ({"temperature": "0.5"}, "temperature"),
        ({"echo": 0}, "echo"),
    ],
)
def test_a_value_of_the_wrong_type_is_a_400_not_converted(served: Served, fields, field):
    error = refusal(complete(served, **fields))

    assert error["param"] == field
    assert error["message"].startswith(f"{field}: Input should be a valid ")


def test_an_integer_is_a_valid_float(served: Served):
    assert complete(served, temperature=0, top_p=1).status_code == 200


@pytest.mark.parametrize(
    "path, fields, message",
    [
        ("/v1/completions", {"prompt": [1.5]},
         "prompt: must be a string, a list of token ids (integers), or a list of those (a batch of prompts)"),
        ("/v1/completions", {"stop": 5}, "stop: must be a string or a list of strings"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         'messages.0.content: must be a string or a list of {"type": "text", "text": ...} parts'),
    ],
)
def test_a_union_field_of_the_wrong_type_is_refused_in_one_sentence(served: Served, path, fields, message):
    response = complete(served, **fields) if path == "/v1/completions" else chat(served, max_tokens=2, **fields)

    assert refusal(response)["message"] == message


# -- fields kvserve does not implement -----------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "text"}},
        {"tools": []},
        {"tool_choice": "none"},
        {"parallel_tool_calls": False},
        {"store": False},
        {"metadata": {"team": "search"}},
        {"service_tier": "auto"},
        {"modalities": ["text"]},
        {"safety_identifier": "user-1"},
        # vLLM's extras at their defaults, as clients written for vLLM send them
        {"skip_special_tokens": True, "include_stop_str_in_output": False, "priority": 0},
        {"add_generation_prompt": True, "continue_final_message": False, "chat_template_kwargs": {}, "echo": False},
        {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
    ],
)
def test_a_neutral_value_of_an_unsupported_field_is_accepted(served: Served, fields):
    response = chat(served, max_tokens=2, **fields)

    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "path, fields, instead",
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, 'leave it out or send {"type": "text"}'),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]},
         "leave it out or send []"),
        ("/v1/chat/completions", {"tool_choice": "required"}, 'leave it out or send "none" or "auto"'),
        ("/v1/chat/completions", {"store": True}, "leave it out or send false"),
        ("/v1/chat/completions", {"reasoning_effort": "low"}, "leave it out"),
        ("/v1/completions", {"suffix": "x"}, 'leave it out or send ""'),
        ("/v1/completions", {"best_of": 2}, "leave it out or send 1"),
        ("/v1/completions", {"include_stop_str_in_output": True}, "leave it out or send false"),
        ("/v1/completions", {"guided_json": {"type": "object"}}, "leave it out"),
        ("/v1/chat/completions", {"add_generation_prompt": False}, "leave it out or send true"),
        ("/v1/chat/completions", {"echo": True}, "leave it out or send false"),  # completions' only
    ],
)
def test_an_unsupported_field_set_to_do_something_is_a_400_that_says_so(served: Served, path, fields, instead):
    response = complete(served, **fields) if path == "/v1/completions" else chat(served, max_tokens=2, **fields)

    error = refusal(response)

    [field] = fields
    assert error["message"] == f"{field}: kvserve does not support this field yet; {instead}"
    assert error["param"] == field


def test_an_unsupported_stream_option_is_a_400_that_says_so(served: Served):
    error = refusal(complete(served, stream=True, stream_options={"continuous_usage_stats": True}))

    assert error["message"] == (
        "stream_options.continuous_usage_stats: kvserve does not support this field yet; leave it out or send false"
    )


@pytest.mark.parametrize(
    "message, used",
    [
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                              "function": {"name": "f", "arguments": "{}"}}]},
         "tool_calls"),
        ({"role": "tool", "tool_call_id": "c1", "content": "42"}, "role 'tool', tool_call_id"),
        ({"role": "function", "name": "f", "content": "42"}, "role 'function'"),
    ],
)
def test_a_conversation_with_tool_calls_is_refused_as_tool_calling(served: Served, message, used):
    # It was refused for the null content, or as a misspelled field, or for its role.
    error = refusal(chat(served, max_tokens=2, messages=[{"role": "user", "content": "Hi"}, message]))

    assert error["message"] == f"messages.1: {used}: kvserve does not support tool calling yet"
    assert error["param"] == "messages"


def test_an_assistant_message_with_no_tool_calls_is_an_ordinary_one(served: Served):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "tool_calls": []},
                {"role": "user", "content": "Go on"}]

    assert chat(served, max_tokens=2, messages=messages).status_code == 200


@pytest.mark.parametrize("model", [None, "absent"])
def test_a_request_without_a_model_gets_the_served_one_as_vllm_serves_it(served: Served, model):
    body = {"prompt": "hello", "max_tokens": 2} | ({} if model == "absent" else {"model": model})

    response = post(served, "/v1/completions", body)

    assert response.status_code == 200, response.text
    assert response.json()["model"] == served.model


def test_an_unknown_field_is_refused_as_unknown(served: Served):
    error = refusal(chat(served, max_tokens=2, temprature=0.5))

    assert error["message"] == "temprature: unknown field; kvserve refuses it rather than ignore it (is it misspelled?)"
    assert error["param"] == "temprature"


# -- output limits -------------------------------------------------------------


def test_a_chat_answer_without_a_limit_may_take_the_rest_of_the_context(served: Served):
    response = chat(served, temperature=0, ignore_eos=True)

    assert response.status_code == 200, response.text
    answer = response.json()
    usage = answer["usage"]
    assert usage["completion_tokens"] == MAX_MODEL_LEN - usage["prompt_tokens"]
    assert usage["total_tokens"] == MAX_MODEL_LEN
    assert answer["choices"][0]["finish_reason"] == "length"


def test_a_completion_without_max_tokens_keeps_openais_legacy_16(served: Served):
    body = {"model": served.model, "prompt": "hello", "temperature": 0, "ignore_eos": True}

    assert post(served, "/v1/completions", body).json()["usage"]["completion_tokens"] == 16


def test_a_conversation_that_fills_the_context_is_refused_saying_why(served: Served):
    error = refusal(chat(served, messages=[{"role": "user", "content": "hello " * 2100}]))

    assert error["param"] == "messages"
    assert "which leaves no room for an answer in max_model_len 2048" in error["message"]


def test_an_error_about_max_completion_tokens_names_it(served: Served):
    error = refusal(chat(served, max_completion_tokens=0))

    assert error["param"] == "max_completion_tokens"
    assert error["message"].startswith("max_completion_tokens")
    assert "max_tokens" not in error["message"].replace("max_completion_tokens", "")


def error_of(message: str, fields: FieldNames) -> dict:
    return json.loads(frontend_error_response(InvalidRequestError(message), fields).body)["error"]


def test_the_pipelines_max_tokens_is_named_as_the_request_named_it():
    error = error_of(
        "sampling_params.max_tokens: 9 prompt tokens + max_tokens 5000 exceed max_model_len 2048",
        FieldNames("messages", "max_completion_tokens"),
    )

    assert error["message"] == (
        "max_completion_tokens: 9 prompt tokens + max_completion_tokens 5000 exceed max_model_len 2048"
    )
    assert error["param"] == "max_completion_tokens"


def test_an_error_about_a_defaulted_max_tokens_says_what_the_default_is():
    error = error_of(
        "request needs up to 257 KV blocks with max_tokens=2039 but the pool has only 8 usable",
        FieldNames("messages", max_tokens_default="the context left after the prompt"),
    )

    assert error["message"].endswith("(max_tokens was not given: it defaults to the context left after the prompt)")


def test_the_pipelines_prompt_is_named_messages_for_a_chat():
    error = error_of("token_ids: the prompt has 3000 tokens; max_model_len is 2048", FieldNames("messages"))

    assert error["message"] == "messages: the prompt has 3000 tokens; max_model_len is 2048"
    assert error["param"] == "messages"


# -- the prompt limit ----------------------------------------------------------


def test_max_prompt_bytes_bounds_a_chat_conversation(served: Served):
    content = "é" * (MAX_PROMPT_BYTES // 4)  # two bytes each: half the limit per message
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": content},
                {"role": "user", "content": "ok"}]

    error = refusal(chat(served, messages=messages, max_tokens=1))

    assert error["param"] == "messages"
    assert error["message"] == (
        f"messages: {MAX_PROMPT_BYTES + 2} bytes of text, over the limit of {MAX_PROMPT_BYTES} (max_prompt_bytes)"
    )


# -- stop strings and logprobs -------------------------------------------------


def greedy_tokens(served: Served, path: str, body: dict) -> tuple[str, list[str]]:
    """The greedy answer's text and its tokens' texts."""
    answer = post(served, path, {"model": served.model, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                                 **body}).json()
    choice = answer["choices"][0]
    if path == "/v1/completions":
        return choice["text"], choice["logprobs"]["tokens"]
    return choice["message"]["content"], [token["token"] for token in choice["logprobs"]["content"]]


def a_stop_string(text: str, tokens: list[str], *, mid_token: bool) -> tuple[str, int]:
    """A stop string that first appears in ``text`` inside token k (``mid_token``) or at its start, running
    into token k + 1; and how many tokens the cut text keeps."""
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    for k in range(1, len(tokens) - 1):
        token, following = tokens[k], tokens[k + 1]
        if not (token + following).isascii() or len(token) < 2 or not following:
            continue
        if not text.startswith("".join(tokens[: k + 2])):  # the tokens' own texts are not the text's here
            continue
        start = offsets[k] + (1 if mid_token else 0)
        stop = text[start : offsets[k + 1] + 1]
        if text.find(stop) == start:
            return stop, k + 1 if mid_token else k
    raise AssertionError(f"no stop string to test with in {tokens}")


@pytest.mark.parametrize("mid_token", [True, False], ids=["mid-token", "at-a-token"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs_end_with_the_text_a_stop_string_cuts(served: Served, mid_token, stream):
    body = {"prompt": "Once upon a time", "logprobs": 1}
    text, tokens = greedy_tokens(served, "/v1/completions", body)
    stop, num_kept = a_stop_string(text, tokens, mid_token=mid_token)

    answer = completion_parts(served, {**body, "stop": stop, "max_tokens": 24, "temperature": 0}, stream)

    cut = text[: text.index(stop)]
    assert answer["text"] == cut
    assert answer["tokens"] == tokens[:num_kept]
    assert len(answer["token_logprobs"]) == len(answer["top_logprobs"]) == num_kept
    assert answer["text_offset"] == [sum(len(t) for t in tokens[:i]) for i in range(num_kept)]
    assert all(offset < len(cut) for offset in answer["text_offset"])


def test_a_stop_string_that_cuts_all_the_text_leaves_empty_logprobs(served: Served):
    body = {"prompt": "Once upon a time", "logprobs": 1}
    text, _ = greedy_tokens(served, "/v1/completions", body)

    answer = completion_parts(served, {**body, "stop": text[:2], "max_tokens": 24, "temperature": 0}, stream=False)

    assert answer == {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def completion_parts(served: Served, body: dict, stream: bool) -> dict:
    """A completion's text and its logprobs' lists, joined over its chunks when streamed."""
    body = {"model": served.model, **body, "stream": stream}
    if not stream:
        choice = post(served, "/v1/completions", body).json()["choices"][0]
        return {"text": choice["text"], **choice["logprobs"]}
    joined: dict = {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in sse_chunks(served, "/v1/completions", body):
        choice = chunk["choices"][0]
        joined["text"] += choice["text"]
        for name, values in (choice["logprobs"] or {}).items():
            joined[name] += values
    return joined


def sse_chunks(served: Served, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{served.base_url}{path}", json=body, timeout=TIMEOUT_S) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_end_with_the_text_a_stop_string_cuts(served: Served, stream):
    body = {"messages": MESSAGES, "logprobs": True}
    text, tokens = greedy_tokens(served, "/v1/chat/completions", body)
    stop, num_kept = a_stop_string(text, tokens, mid_token=True)
    request = {"model": served.model, **body, "stop": stop, "max_tokens": 24, "temperature": 0, "stream": stream}

    if stream:
        chunks = sse_chunks(served, "/v1/chat/completions", request)
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        logprobs = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["content"]]
    else:
        choice = post(served, "/v1/chat/completions", request).json()["choices"][0]
        content, logprobs = choice["message"]["content"], choice["logprobs"]["content"]

    assert content == text[: text.index(stop)]
    assert [token["token"] for token in logprobs] == tokens[:num_kept]


# -- chat messages and chunks --------------------------------------------------

NAMED_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}{% if m.name is defined %} ({{ m.name }}){% endif %}: "
    "{{ m['content'] }}\n{% endfor %}assistant:"
)


def test_a_messages_name_reaches_the_chat_template(served: Served):
    config = ServerConfig(port=0, http_port=0)
    http = served.server._run(start_http_server(served.server.server.frontend, config, chat_template=NAMED_TEMPLATE))
    try:
        def prompt_tokens(message: dict) -> int:
            body = {"model": served.model, "messages": [message], "max_tokens": 1}
            response = httpx.post(f"http://127.0.0.1:{http.port}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens"]

        anonymous = prompt_tokens({"role": "user", "content": "hi"})
        named = prompt_tokens({"role": "user", "content": "hi", "name": "bob"})
    finally:
        served.server._run(http.stop(grace_s=1.0))

    tokenizer = served.tokenizer
    assert named == len(tokenizer("user (bob): hi\nassistant:", add_special_tokens=False)["input_ids"])
    assert anonymous == len(tokenizer("user: hi\nassistant:", add_special_tokens=False)["input_ids"])


def test_only_the_first_chunk_of_a_chat_choice_has_a_role(served: Served):
    body = {"model": served.model, "messages": MESSAGES, "max_tokens": 4, "stream": True}

    chunks = sse_chunks(served, "/v1/chat/completions", body)

    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len(chunks) > 1
    assert all("role" not in chunk["choices"][0]["delta"] for chunk in chunks[1:])


def test_head_health_answers_as_get_without_a_body(served: Served):
    response = httpx.head(f"{served.base_url}/health", timeout=TIMEOUT_S)

    assert response.status_code == 200
    assert response.content == b""


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(served: Served):
    """lm-evaluation-harness's loglikelihood request: the prompt echoed with its tokens' logprobs."""
    prompt = "the quick brown fox jumps"
    response = complete(served, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    prompt_ids = served.tokenizer(prompt)["input_ids"]
    assert choice["text"].startswith(prompt) and len(choice["text"]) > len(prompt)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt_ids) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    reference = hf_log_softmax(load_hf_model(served.model_dir), prompt_ids[:1], prompt_ids[1:])
    expected = reference.gather(-1, torch.tensor(prompt_ids[1:])[:, None]).squeeze(-1).tolist()
    assert logprobs["token_logprobs"][1 : len(prompt_ids)] == pytest.approx(expected, abs=1e-4)
