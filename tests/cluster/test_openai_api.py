"""The OpenAI-compatible HTTP API against a real server, through the official ``openai`` package and ``httpx``.

The server: ``openai_served`` (one replica of the tiny model, its gRPC and HTTP servers).
"""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvserve import LLM, SamplingParams
from kvserve.client import Client
from kvserve.cluster.config import ServerConfig
from kvserve.cluster.http_server import bind_socket, start_http_server
from kvserve.cluster.metrics import FrontendMetrics
from kvserve.proto import generate_pb2, generate_pb2_grpc
from tests.engine.hf_reference import hf_log_softmax, load_hf_model
from tests.cluster.openai_served import (  # noqa: F401 - fixtures
    BLOCK_SIZE,
    MAX_BODY_BYTES,
    MAX_CONCURRENT_REQUESTS,
    TIMEOUT_S,
    Served,
    grpc_client,
    sdk,
    served,
)
from tests.cluster.server_thread import wait_until_idle

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
# Several seconds of decoding (~3 ms a token here): still running long after a test leaves it.
LONG = {"max_tokens": 1500, "temperature": 0.0, "ignore_eos": True}
# Under the ~4.5 s that LONG takes to end by itself, with room for a loaded machine.
ABORT_TIMEOUT_S = 3.0
# A template given with --chat-template, in place of the model's own.
OTHER_CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


# -- endpoints -------------------------------------------------------------------


def test_models_lists_the_served_model(served: Served, sdk: openai.OpenAI):
    models = sdk.models.list()

    assert [m.id for m in models.data] == [served.model]
    assert models.data[0].owned_by == "kvserve"


def test_a_model_is_retrieved_by_its_id(served: Served, sdk: openai.OpenAI):
    assert sdk.models.retrieve(served.model).id == served.model
    with pytest.raises(openai.NotFoundError) as info:
        sdk.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found"


def test_health_is_ok_while_the_replica_serves(served: Served):
    assert httpx.get(f"{served.base_url}/health").status_code == 200


def test_a_completion_is_what_the_grpc_api_generates(served: Served, sdk: openai.OpenAI, grpc_client: Client):
    expected = grpc_client.generate("hello world", max_tokens=8, temperature=0.0, ignore_eos=True)

    completion = sdk.completions.create(model=served.model, prompt="hello world", max_tokens=8, **GREEDY)

    assert completion.object == "text_completion"
    assert completion.model == served.model
    assert completion.id.startswith("cmpl-")
    assert len(completion.choices) == 1
    assert completion.choices[0].text == expected.text
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.prompt_tokens == expected.usage.prompt_tokens
    assert completion.usage.completion_tokens == 8
    assert completion.usage.total_tokens == expected.usage.prompt_tokens + 8


def test_a_token_id_prompt_is_accepted(served: Served, sdk: openai.OpenAI):
    completion = sdk.completions.create(model=served.model, prompt=[5, 6, 7, 8], max_tokens=3, **GREEDY)

    assert completion.usage.prompt_tokens == 4
    assert completion.usage.completion_tokens == 3


def test_a_repeated_prompt_reports_its_cached_tokens(served: Served, sdk: openai.OpenAI):
    prompt = list(range(300, 300 + 3 * BLOCK_SIZE + 2))
    first = sdk.completions.create(model=served.model, prompt=prompt, max_tokens=2, **GREEDY)
    second = sdk.completions.create(model=served.model, prompt=prompt, max_tokens=2, **GREEDY)

    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK_SIZE


def test_a_streamed_completion_adds_up_to_the_whole_one(served: Served, sdk: openai.OpenAI):
    whole = sdk.completions.create(model=served.model, prompt="stream me", max_tokens=12, **GREEDY)

    chunks = list(sdk.completions.create(model=served.model, prompt="stream me", max_tokens=12, stream=True, **GREEDY))

    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert len(chunks) > 1
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert len({c.id for c in chunks}) == 1
    assert all(c.usage is None for c in chunks)


def test_include_usage_adds_a_last_chunk_with_the_usage_and_no_choices(served: Served, sdk: openai.OpenAI):
    chunks = list(
        sdk.completions.create(
            model=served.model, prompt=[5, 6, 7], max_tokens=4, stream=True, stream_options={"include_usage": True},
            **GREEDY,
        )
    )

    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == 3
    assert chunks[-1].usage.completion_tokens == 4
    assert chunks[-2].choices[0].finish_reason == "length"


def test_the_sse_stream_ends_with_done(served: Served):
    body = {"model": served.model, "prompt": "raw", "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body, timeout=TIMEOUT_S) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]

    assert events[-1] == "data: [DONE]"
    assert all(event.startswith("data: ") for event in events)
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] is not None


def test_kvserve_extras_are_accepted_as_extra_body_fields(served: Served, sdk: openai.OpenAI):
    prompt = list(range(400, 400 + 2 * BLOCK_SIZE + 1))
    sdk.completions.create(model=served.model, prompt=prompt, max_tokens=1, **GREEDY)

    completion = sdk.completions.create(
        model=served.model, prompt=prompt, max_tokens=3,
        extra_body={"top_k": 5, "ignore_eos": True, "cache_salt": "tenant-b"},
    )

    assert completion.usage.completion_tokens == 3
    # Another tenant's salt: nothing of the first request's cached prompt is shared.
    assert completion.usage.prompt_tokens_details.cached_tokens == 0


def test_the_sdks_penalties_logit_bias_and_echo_reach_the_model(served: Served, sdk: openai.OpenAI, grpc_client: Client):
    prompt = [5, 6, 7, 8]
    # A bias of 100 wins every step; a frequency penalty of 2 lets other tokens in after a while.
    biased = sdk.completions.create(model=served.model, prompt=prompt, max_tokens=24, logit_bias={"42": 10},
                                    **GREEDY)
    penalised = sdk.completions.create(model=served.model, prompt=prompt, max_tokens=24, logit_bias={"42": 10},
                                       frequency_penalty=2.0, presence_penalty=0.5, **GREEDY)
    expected = grpc_client.generate(prompt, max_tokens=24, temperature=0.0, ignore_eos=True, logit_bias={42: 10.0},
                                    frequency_penalty=2.0, presence_penalty=0.5)
    assert penalised.choices[0].text == expected.text != biased.choices[0].text
    # echo with logprobs, as lm-evaluation-harness sends it: the SDK parses the nulls of the first prompt token.
    echoed = sdk.completions.create(model=served.model, prompt=prompt, max_tokens=1, echo=True, logprobs=1, **GREEDY)
    logprobs = echoed.choices[0].logprobs
    assert logprobs.token_logprobs[0] is None and len(logprobs.token_logprobs) == len(prompt) + 1
    assert all(isinstance(value, float) for value in logprobs.token_logprobs[1:])


def test_a_stop_token_id_ends_the_completion_with_reason_stop(served: Served, grpc_client: Client):
    tokens = grpc_client.generate([5, 6, 7], max_tokens=6, temperature=0.0, ignore_eos=True).token_ids
    body = {"model": served.model, "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0,
            "stop_token_ids": [tokens[2]]}

    response = httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=TIMEOUT_S).json()

    assert response["choices"][0]["finish_reason"] == "stop"
    assert response["usage"]["completion_tokens"] == tokens.index(tokens[2]) + 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_completion_and_is_not_sent(served: Served, sdk: openai.OpenAI, stream):
    whole = sdk.completions.create(model=served.model, prompt="stop here", max_tokens=24, **GREEDY).choices[0].text
    stop = whole[len(whole) // 2 :][:3]

    answer = sdk.completions.create(
        model=served.model, prompt="stop here", max_tokens=24, stop=[stop, "\u2603 never"], stream=stream, **GREEDY
    )

    chunks = list(answer) if stream else [answer]
    assert "".join(c.choices[0].text for c in chunks) == whole[: whole.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stop_string_ends_a_chat_answer_too(served: Served, sdk: openai.OpenAI):
    whole = sdk.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=24, **GREEDY)
    text = whole.choices[0].message.content
    stop = text[len(text) // 2 :][:3]

    chat = sdk.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=24, stop=stop, **GREEDY)

    assert chat.choices[0].message.content == text[: text.index(stop)]
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage.completion_tokens < 24


# -- chat ------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


def rendered(served: Served, messages: list[dict]) -> list[int]:
    """The prompt the chat template makes of ``messages``, as the server must tokenize it."""
    text = served.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if messages == MESSAGES:
        assert text == "<s><|system|>be brief\n<|user|>hello there\n<|assistant|>"
    return served.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_chat_completion_answers_the_rendered_conversation(served: Served, sdk: openai.OpenAI, grpc_client: Client):
    expected = grpc_client.generate(rendered(served, MESSAGES), max_tokens=6, temperature=0.0, ignore_eos=True)

    chat = sdk.chat.completions.create(model=served.model, messages=MESSAGES, max_completion_tokens=6, **GREEDY)

    assert chat.object == "chat.completion"
    assert chat.id.startswith("chatcmpl-")
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == expected.text
    assert chat.choices[0].finish_reason == "length"
    # One BOS: the template's, not another from the tokenizer.
    assert chat.usage.prompt_tokens == expected.usage.prompt_tokens == len(rendered(served, MESSAGES))


def test_vllms_repetition_penalty_is_served_over_http_and_grpc_as_in_process(
    served: Served, sdk: openai.OpenAI, grpc_client: Client
):
    prompt = [5, 6, 7, 8, 5, 6, 9, 10, 11, 5]
    penalised = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True, "repetition_penalty": 1.6}
    conversation = rendered(served, MESSAGES)
    with LLM(served.model_dir, block_size=BLOCK_SIZE, num_blocks=64) as llm:
        expected, expected_chat = llm.generate([prompt, conversation], SamplingParams(**penalised), progress=False)

    completion = sdk.completions.create(
        model=served.model, prompt=prompt, max_tokens=16, temperature=0.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.6},
    )
    chat = sdk.chat.completions.create(
        model=served.model, messages=MESSAGES, max_completion_tokens=16, temperature=0.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.6},
    )
    streamed = grpc_client.generate(prompt, **penalised)
    plain = grpc_client.generate(prompt, **{**penalised, "repetition_penalty": 1.0})

    assert list(streamed.token_ids) == expected.token_ids != list(plain.token_ids)
    assert completion.choices[0].text == streamed.text == expected.text
    assert chat.choices[0].message.content == expected_chat.text


def test_a_streamed_chat_says_the_role_first_and_adds_up_to_the_whole_answer(served: Served, sdk: openai.OpenAI):
    whole = sdk.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=8, **GREEDY)

    chunks = list(
        sdk.chat.completions.create(
            model=served.model, messages=MESSAGES, max_tokens=8, stream=True, stream_options={"include_usage": True},
            **GREEDY,
        )
    )

    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 8


def test_text_parts_are_joined_into_the_message_a_line_each(served: Served, sdk: openai.OpenAI):
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]
    messages = [MESSAGES[0], {"role": "user", "content": parts}]

    chat = sdk.chat.completions.create(model=served.model, messages=messages, max_tokens=1, **GREEDY)

    # vLLM's rule for a template that reads strings
    assert chat.usage.prompt_tokens == len(rendered(served, [MESSAGES[0], {"role": "user", "content": "hello\nthere"}]))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"messages": []}, "messages: List should have at least 1 item"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role: "),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens: differs from max_tokens"),
        ({"top_logprobs": 2}, "top_logprobs: needs logprobs to be true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs: must be an integer in [0, 20], got 21"),
    ],
)
def test_a_bad_chat_request_is_a_400_naming_the_field(served: Served, fields, message):
    body = {"model": served.model, "messages": MESSAGES, **fields}

    response = httpx.post(f"{served.base_url}/v1/chat/completions", json=body, timeout=TIMEOUT_S)

    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def chat_on_a_server_of_its_own(served: Served, chat_template: str | None) -> httpx.Response:
    """``MESSAGES`` sent to a second HTTP server of the same front end, started with ``chat_template``."""
    config = ServerConfig(port=0, http_port=0)
    http = served.server._run(start_http_server(served.server.server.frontend, config, chat_template=chat_template))
    try:
        body = {"model": served.model, "messages": MESSAGES, "max_tokens": 2}
        return httpx.post(f"http://127.0.0.1:{http.port}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    finally:
        served.server._run(http.stop(grace_s=1.0))


def test_a_chat_template_given_to_the_server_replaces_the_models(served: Served):
    response = chat_on_a_server_of_its_own(served, OTHER_CHAT_TEMPLATE)

    assert response.status_code == 200, response.text
    text = "system: be brief\nuser: hello there\nassistant:"
    assert text != served.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    # As rendered: the template, not the tokenizer, adds special tokens (here none).
    assert response.json()["usage"]["prompt_tokens"] == len(served.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_chat_without_a_template_is_a_400_that_says_how_to_give_one(served: Served):
    tokenizer = served.server.server.frontend.tokenizer
    own, tokenizer.chat_template = tokenizer.chat_template, None  # a model that ships none
    try:
        response = chat_on_a_server_of_its_own(served, None)
    finally:
        tokenizer.chat_template = own

    assert response.status_code == 400
    assert "this model has no chat template; start the server with --chat-template FILE" in response.text


def test_a_chat_template_that_does_not_compile_is_the_servers_error_not_the_requests(served: Served, caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve.cluster.openai_chat"):
        response = chat_on_a_server_of_its_own(served, "{{ messages[0].content }")

    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "internal_error" and error["param"] is None
    assert error["message"] == "the server's chat template does not compile"
    said = [record.getMessage() for record in caplog.records]
    assert any("will answer every request with an error: the chat template does not compile: line 1" in line
               for line in said), said  # at start-up
    assert any("a chat completion failed: the chat template does not compile" in line for line in said), said


# -- metrics -----------------------------------------------------------------------


def scrape(served: Served) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``, read with prometheus_client's own text parser."""
    response = httpx.get(f"{served.base_url}/metrics", timeout=TIMEOUT_S)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_count_exactly_the_requests_sent_and_their_tokens(served: Served, sdk: openai.OpenAI):
    before = scrape(served)
    served_ones = [
        sdk.completions.create(model=served.model, prompt=[5, 6, 7], max_tokens=4, **GREEDY),
        sdk.completions.create(model=served.model, prompt="metrics", max_tokens=3, **GREEDY),
    ]
    list(sdk.completions.create(model=served.model, prompt=[8, 9], max_tokens=5, stream=True, **GREEDY))
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model=served.model, prompt="bad", top_p=5.0)

    after = scrape(served)

    assert moved(before, after, "kvserve_requests_total", code="200") == 3
    assert moved(before, after, "kvserve_requests_total", code="400") == 1
    prompt_tokens = sum(c.usage.prompt_tokens for c in served_ones) + 2
    assert moved(before, after, "kvserve_prompt_tokens_total") == prompt_tokens
    assert moved(before, after, "kvserve_generation_tokens_total") == 4 + 3 + 5
    assert moved(before, after, "kvserve_time_to_first_token_seconds_count") == 3
    assert moved(before, after, "kvserve_e2e_request_latency_seconds_count") == 3
    # Every token after the first of each request: its time per output token.
    assert moved(before, after, "kvserve_inter_token_latency_seconds_count") == 3 + 2 + 4
    assert moved(before, after, "kvserve_e2e_request_latency_seconds_sum") > 0


def test_metrics_count_a_request_of_n_choices_once_with_its_usage(served: Served, sdk: openai.OpenAI):
    before = scrape(served)
    whole = sdk.completions.create(model=served.model, prompt="many ways", n=3, max_tokens=4, **GREEDY)
    *_, last = sdk.completions.create(
        model=served.model, prompt="many ways", n=2, max_tokens=4, stream=True,
        stream_options={"include_usage": True}, **GREEDY,
    )

    after = scrape(served)

    assert moved(before, after, "kvserve_requests_total", code="200") == 2
    assert moved(before, after, "kvserve_prompt_tokens_total") == whole.usage.prompt_tokens + last.usage.prompt_tokens
    assert moved(before, after, "kvserve_generation_tokens_total") == 3 * 4 + 2 * 4
    assert moved(before, after, "kvserve_time_to_first_token_seconds_count") == 2
    assert moved(before, after, "kvserve_e2e_request_latency_seconds_count") == 2
    # Every token after each choice's first: its time per output token.
    assert moved(before, after, "kvserve_inter_token_latency_seconds_count") == 3 * 3 + 2 * 3


def test_metrics_count_a_grpc_call_as_one_request_too(served: Served, grpc_client: Client):
    before = scrape(served)
    result = grpc_client.generate("over grpc", max_tokens=3, temperature=0.0, ignore_eos=True)

    after = scrape(served)

    assert moved(before, after, "kvserve_requests_total", code="200") == 1
    assert moved(before, after, "kvserve_prompt_tokens_total") == result.usage.prompt_tokens
    assert moved(before, after, "kvserve_generation_tokens_total") == 3


def test_metrics_count_the_requests_refused_before_the_pipeline(served: Served, sdk: openai.OpenAI):
    before = scrape(served)
    url = f"{served.base_url}/v1/completions"
    refusals = [
        httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}),
        httpx.post(url, json={"model": served.model, "prompt": "x", "max_tokns": 3}),
        httpx.post(url, json={"model": served.model, "prompt": "x", "n": 0}),
        httpx.post(url, json={"model": "gpt-4", "prompt": "x"}),
        httpx.post(url, json={"model": served.model, "prompt": "x" * MAX_BODY_BYTES}),
        httpx.post(f"{served.base_url}/v1/chat/completions", json={"model": served.model, "messages": []}),
    ]

    after = scrape(served)

    assert [r.status_code for r in refusals] == [400, 400, 400, 404, 413, 400]
    assert moved(before, after, "kvserve_requests_total", code="400") == 4
    assert moved(before, after, "kvserve_requests_total", code="404") == 1
    assert moved(before, after, "kvserve_requests_total", code="413") == 1
    assert moved(before, after, "kvserve_requests_total", code="200") == 0


def scrape_once_counted(served: Served, before: dict, code: str) -> dict:
    """The metrics once a request has been counted with ``code`` since ``before`` (an aborted
    request is counted when its pipeline closes, just after its blocks come back)."""
    deadline = time.monotonic() + TIMEOUT_S
    while moved(before, after := scrape(served), "kvserve_requests_total", code=code) == 0:
        assert time.monotonic() < deadline, f"no request was counted with {code}"
        time.sleep(0.05)
    return after


def test_metrics_count_a_stream_the_client_left_as_499_with_no_served_figures(
    served: Served, grpc_client: Client
):
    before = scrape(served)
    body = {"model": served.model, "prompt": [5, 6, 7], "max_tokens": 500, "stream": True, **GREEDY["extra_body"]}
    with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body, timeout=TIMEOUT_S) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # its first chunk; then the client leaves
    wait_until_idle(grpc_client, TIMEOUT_S)  # aborted: its blocks came back
    after = scrape_once_counted(served, before, "499")

    assert moved(before, after, "kvserve_requests_total", code="499") == 1
    assert moved(before, after, "kvserve_requests_total", code="200") == 0
    assert moved(before, after, "kvserve_time_to_first_token_seconds_count") == 1
    # Unserved: no usage to count, no end to time.
    assert moved(before, after, "kvserve_prompt_tokens_total") == 0
    assert moved(before, after, "kvserve_generation_tokens_total") == 0
    assert moved(before, after, "kvserve_e2e_request_latency_seconds_count") == 0


def test_metrics_count_a_client_that_left_in_the_middle_of_its_body_as_499_not_400(served: Served):
    # FastAPI answers such a request 400 ("There was an error parsing the body") to no one.
    before = scrape(served)
    host, port = served.base_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as connection:
        connection.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: kvserve\r\nContent-Type: application/json\r\n"
            b'Content-Length: 500\r\n\r\n{"model":'
        )
        time.sleep(0.2)  # the server is reading the body
    after = scrape_once_counted(served, before, "499")

    assert moved(before, after, "kvserve_requests_total", code="499") == 1
    assert moved(before, after, "kvserve_requests_total", code="400") == 0


def test_metrics_count_a_grpc_call_whose_deadline_passed_as_504_not_as_a_client_that_left(
    served: Served, grpc_client: Client
):
    before = scrape(served)
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=[5, 6, 7]),
        sampling_params=generate_pb2.SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True),
    )
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            for _ in stub.Generate(request, timeout=0.3):  # 1,500 steps take seconds
                pass
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until_idle(grpc_client, TIMEOUT_S)  # aborted: its blocks came back
    after = scrape_once_counted(served, before, "504")

    assert moved(before, after, "kvserve_requests_total", code="504") == 1
    assert moved(before, after, "kvserve_requests_total", code="499") == 0
    assert moved(before, after, "kvserve_generation_tokens_total") == 0


def test_metrics_report_each_replicas_state(served: Served):
    samples = scrape(served)

    assert samples[("kvserve_replica_healthy", (("replica", "0"),))] == 1
    assert samples[("kvserve_num_requests_running", (("replica", "0"),))] == 0
    assert samples[("kvserve_num_requests_waiting", (("replica", "0"),))] == 0
    assert samples[("kvserve_kv_cache_usage_ratio", (("replica", "0"),))] == 0


# -- errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"top_p": 2.0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"n": 0}, "n"),
        ({"n": MAX_CONCURRENT_REQUESTS + 1}, "n"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
        ({"extra_body": {"prompt_logprobs": -1}}, "prompt_logprobs"),
        ({"extra_body": {"prompt_logprobs": "1"}}, "prompt_logprobs"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ],
)
def test_invalid_input_is_a_400_naming_the_field(served: Served, sdk: openai.OpenAI, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=served.model, prompt="hello", **fields)

    assert info.value.status_code == 400
    error = info.value.body
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"].startswith(param)
    assert "sampling_params" not in error["message"]  # the gRPC API's name of the fields


def test_a_prompt_too_long_is_a_400_naming_the_prompt(served: Served, sdk: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=served.model, prompt=[5] * 3000, max_tokens=1)

    assert info.value.body["param"] == "prompt"
    assert info.value.body["message"].startswith("prompt: the prompt has 3000 tokens")


def test_a_streamed_request_with_invalid_input_is_a_400_too(served: Served, sdk: openai.OpenAI):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        sdk.completions.create(model=served.model, prompt="hello", top_p=0.0, stream=True)


def test_an_unknown_model_is_a_404(sdk: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as info:
        sdk.completions.create(model="gpt-4", prompt="hello")

    assert info.value.body["code"] == "model_not_found"
    assert "gpt-4" in info.value.body["message"]


NOT_AN_OBJECT = "the request body must be a JSON object, sent with Content-Type: application/json"


@pytest.mark.parametrize(
    "content, content_type, message, param",
    [
        (b'{"model": "tiny-llama", "prompt": "x", "max_tokns": 3}', "application/json",
         "max_tokns: unknown field; kvserve refuses it rather than ignore it (is it misspelled?)", "max_tokns"),
        (b'{"model": "tiny-llama"}', "application/json", "prompt: Field required", "prompt"),
        (b'{"model": "tiny-llama", "prompt": "x", "max_tokens": "many"}', "application/json", "max_tokens: ",
         "max_tokens"),
        (b"{not json", "application/json", "the request body is not valid JSON", None),
        (b'{"model": "tiny-llama", "prompt": "x"}', "text/plain", NOT_AN_OBJECT, None),
        (b'["tiny-llama", "x"]', "application/json", NOT_AN_OBJECT, None),
        (b"", "application/json", NOT_AN_OBJECT, None),
    ],
)
def test_a_malformed_body_is_a_400_in_openais_error_shape(served: Served, content, content_type, message, param):
    response = httpx.post(f"{served.base_url}/v1/completions", content=content, headers={"content-type": content_type})

    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}


def test_stream_options_without_stream_is_a_400(served: Served, sdk: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=served.model, prompt="hello", stream_options={"include_usage": True})

    assert info.value.body["param"] == "stream_options"


def test_a_body_over_the_limit_is_a_413(served: Served):
    body = {"model": served.model, "prompt": "x" * MAX_BODY_BYTES}

    response = httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=TIMEOUT_S)

    assert response.status_code == 413
    assert response.json()["error"]["message"] == (
        f"the request body is larger than the server's limit of {MAX_BODY_BYTES} bytes"
    )


def test_a_streamed_body_over_the_limit_is_a_413_too(served: Served):
    # No content-length: the body arrives in chunks and is counted as it comes.
    def chunks():
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    response = httpx.post(
        f"{served.base_url}/v1/completions", content=chunks(), headers={"content-type": "application/json"},
        timeout=TIMEOUT_S,
    )

    assert response.status_code == 413
    assert "larger than the server's limit" in response.json()["error"]["message"]


def test_an_unknown_path_is_a_404_in_openais_error_shape(served: Served):
    response = httpx.get(f"{served.base_url}/v1/nothing")

    assert response.status_code == 404
    assert response.json()["error"]["message"] == "Not Found"


def test_past_the_limit_of_concurrent_requests_is_a_429(served: Served, sdk: openai.OpenAI, grpc_client: Client):
    # The gRPC and HTTP front doors share one limit.
    streams = [grpc_client.stream(f"busy {i}", **LONG) for i in range(MAX_CONCURRENT_REQUESTS)]
    try:
        for stream in streams:
            next(stream)
        with pytest.raises(openai.RateLimitError) as info:
            sdk.completions.create(model=served.model, prompt="one too many", max_tokens=1)
        assert info.value.status_code == 429
        assert info.value.response.headers["retry-after"] == "1"
        assert f"limit of {MAX_CONCURRENT_REQUESTS} concurrent requests" in info.value.body["message"]
    finally:
        for stream in streams:
            stream.close()
    wait_until_idle(grpc_client, ABORT_TIMEOUT_S)


# -- disconnects -------------------------------------------------------------------


def test_leaving_a_stream_aborts_its_request_and_frees_its_blocks(served: Served, grpc_client: Client):
    body = {"model": served.model, "prompt": "leave me", "stream": True, **LONG}
    with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body, timeout=TIMEOUT_S) as response:
        # NOTE: the iterator is kept: dropped, it closes the response, which leaves the stream at once.
        lines = response.iter_lines()
        next(lines)
        assert grpc_client.get_stats()[0].num_running == 1

    wait_until_idle(grpc_client, ABORT_TIMEOUT_S)


def test_a_client_that_leaves_before_its_completion_aborts_its_request(served: Served, grpc_client: Client):
    body = {"model": served.model, "prompt": "too slow", **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=0.5)

    wait_until_idle(grpc_client, ABORT_TIMEOUT_S)


def test_a_taken_port_is_refused_with_a_clear_error(served: Served):
    port = int(served.base_url.rsplit(":", 1)[1])
    with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port} for HTTP: Address already in use"):
        bind_socket("127.0.0.1", port)


def test_the_grafana_dashboard_charts_only_metrics_the_server_exports():
    dashboard = json.loads((Path(__file__).parents[2] / "deploy" / "grafana-dashboard.json").read_text())
    charted = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"kvserve_[a-z0-9_]+", target["expr"])
    }
    exported = {
        sample_name
        for family in FrontendMetrics().registry.collect()
        for sample_name in (family.name, f"{family.name}_total", f"{family.name}_bucket")
    }
    assert charted
    assert charted <= exported, charted - exported


def test_metrics_carry_the_schedulers_prefix_cache_preemption_and_routing_counters(served: Served, sdk: openai.OpenAI):
    prompt = list(range(100, 100 + 4 * BLOCK_SIZE + 1))  # four whole blocks a cache can serve, and one token
    before = scrape(served)
    first = sdk.completions.create(model=served.model, prompt=prompt, max_tokens=2, **GREEDY)
    second = sdk.completions.create(model=served.model, prompt=prompt, max_tokens=2, **GREEDY)
    after = scrape(served)

    assert (first.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens_details.cached_tokens) == (
        0, 4 * BLOCK_SIZE
    )
    assert moved(before, after, "kvserve_prefix_cache_queries_tokens_total", replica="0") == 2 * len(prompt)
    assert moved(before, after, "kvserve_prefix_cache_hits_tokens_total", replica="0") == 4 * BLOCK_SIZE
    assert moved(before, after, "kvserve_preemptions_total", replica="0") == 0
    assert ("kvserve_preemptions_total", (("replica", "0"),)) in after
    assert after[("kvserve_replica_failures_total", (("replica", "0"),))] == 0
    from kvserve.scheduler.routing.policies import DEFAULT_POLICY as policy  # the served cluster's

    assert moved(before, after, "kvserve_routing_decisions_total", policy=policy, outcome="miss") == 1
    assert moved(before, after, "kvserve_routing_decisions_total", policy=policy, outcome="hit") == 1
    assert moved(before, after, "kvserve_routing_decisions_total", policy=policy, outcome="partial") == 0


# -- logprobs --------------------------------------------------------------------


def test_completion_logprobs_are_transformers_log_softmax_in_openais_legacy_shape(
    served: Served, sdk: openai.OpenAI, grpc_client: Client
):
    prompt = [5, 6, 7, 8, 9]
    token_ids = grpc_client.generate(prompt, max_tokens=6, temperature=0.0, ignore_eos=True).token_ids
    reference = hf_log_softmax(load_hf_model(served.model_dir), prompt, token_ids)

    completion = sdk.completions.create(model=served.model, prompt=prompt, max_tokens=6, logprobs=3, **GREEDY)

    logprobs = completion.choices[0].logprobs
    tokens = [served.tokenizer.decode([t]) for t in token_ids]
    assert logprobs.tokens == tokens
    expected = reference.gather(-1, torch.tensor(token_ids)[:, None]).squeeze(-1).tolist()
    assert logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    # Greedy: the sampled token is the most likely one, and among its position's 3 best.
    for token, logprob, top in zip(tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and top[token] == logprob == max(top.values())
    assert logprobs.text_offset == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_streamed_completion_logprobs_add_up_to_the_whole_ones(served: Served, sdk: openai.OpenAI):
    whole = sdk.completions.create(model=served.model, prompt="stream me", max_tokens=10, logprobs=2, **GREEDY)

    chunks = list(
        sdk.completions.create(model=served.model, prompt="stream me", max_tokens=10, logprobs=2, stream=True, **GREEDY)
    )

    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    expected = whole.choices[0].logprobs
    assert [t for lp in streamed for t in lp.tokens] == expected.tokens
    assert [v for lp in streamed for v in lp.token_logprobs] == expected.token_logprobs
    assert [o for lp in streamed for o in lp.text_offset] == expected.text_offset
    assert [d for lp in streamed for d in lp.top_logprobs] == expected.top_logprobs


def test_chat_logprobs_come_in_openais_chat_shape(served: Served, sdk: openai.OpenAI):
    chat = sdk.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=2, **GREEDY
    )

    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    # Each token's own bytes: together the answer's (a part of a character is its bytes, not U+FFFD's).
    answer = b"".join(bytes(entry.bytes) for entry in content)
    assert answer.decode(errors="replace") == chat.choices[0].message.content
    for entry in content:
        if "\ufffd" not in entry.token:
            assert entry.bytes == list(entry.token.encode())
        assert [top.logprob for top in entry.top_logprobs] == sorted((top.logprob for top in entry.top_logprobs),
                                                                     reverse=True)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob <= 0.0


def test_streamed_chat_logprobs_add_up_to_the_whole_ones(served: Served, sdk: openai.OpenAI):
    whole = sdk.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=8, logprobs=True, **GREEDY)

    chunks = list(sdk.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=8, logprobs=True, stream=True, **GREEDY
    ))

    streamed = [entry for c in chunks if c.choices[0].logprobs is not None for entry in c.choices[0].logprobs.content]
    assert streamed == whole.choices[0].logprobs.content
    assert all(entry.top_logprobs == [] for entry in streamed)


def test_a_request_without_logprobs_gets_none(served: Served, sdk: openai.OpenAI):
    completion = sdk.completions.create(model=served.model, prompt="plain", max_tokens=3, **GREEDY)
    chat = sdk.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=3, **GREEDY)
    chunks = list(sdk.completions.create(model=served.model, prompt="plain", max_tokens=3, stream=True, **GREEDY))

    assert completion.choices[0].logprobs is None
    assert chat.choices[0].logprobs is None
    assert all(c.choices[0].logprobs is None for c in chunks)


def test_the_grpc_client_returns_one_logprob_per_token_up_to_a_stop_string(served: Served, grpc_client: Client):
    whole = grpc_client.generate("stop here", max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    stop = whole.text[len(whole.text) // 2 :][:3]

    stopped = grpc_client.generate("stop here", max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1, stop=stop)

    assert len(whole.logprobs) == len(whole.token_ids) == 16
    assert all(t.top_token_ids == (token_id,) for t, token_id in zip(whole.logprobs, whole.token_ids, strict=True))
    assert stopped.finish_reason == "stop"
    assert stopped.logprobs == whole.logprobs[: len(stopped.token_ids)]
    assert grpc_client.generate("stop here", max_tokens=2).logprobs is None


# -- prompt logprobs (vLLM's extension) -------------------------------------------


def assert_vllm_prompt_logprobs(got: list, token_ids: list[int], want: tuple, num_top: int, tokenizer) -> None:
    """``got`` (an answer's ``prompt_logprobs``) is ``want`` (the gRPC client's, for the prompt ``token_ids``)
    in vLLM's shape: null first, then the prompt token's entry and the ``num_top`` likeliest, ranked."""
    assert len(got) == len(want) == len(token_ids)
    assert got[0] is None and want[0] is None
    for token_id, entry, expected in zip(token_ids[1:], got[1:], want[1:], strict=True):
        top_ids = list(expected.top_token_ids)
        assert len(top_ids) == num_top
        assert list(entry) == [str(token_id), *(str(t) for t in top_ids if t != token_id)]
        assert entry[str(token_id)]["logprob"] == pytest.approx(expected.logprob, abs=1e-5)
        assert entry[str(token_id)]["rank"] == (top_ids.index(token_id) + 1 if token_id in top_ids else None)
        assert [entry[str(t)]["logprob"] for t in top_ids] == pytest.approx(expected.top_logprobs, abs=1e-5)
        assert [entry[str(t)]["rank"] for t in top_ids] == list(range(1, num_top + 1))
        assert all(value["decoded_token"] == tokenizer.decode([int(key)]) for key, value in entry.items())


def test_completion_prompt_logprobs_are_the_grpc_apis_in_vllms_shape(served: Served, grpc_client: Client):
    prompt = "the quick brown fox jumps"
    want = grpc_client.generate(prompt, max_tokens=1, prompt_logprobs=3).prompt_logprobs

    response = httpx.post(
        f"{served.base_url}/v1/completions", timeout=TIMEOUT_S,
        json={"model": served.model, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 3},
    )

    assert response.status_code == 200, response.text
    token_ids = served.tokenizer(prompt)["input_ids"]
    assert_vllm_prompt_logprobs(response.json()["choices"][0]["prompt_logprobs"], token_ids, want, 3, served.tokenizer)


def test_chat_prompt_logprobs_come_once_for_the_rendered_conversation(
    served: Served, sdk: openai.OpenAI, grpc_client: Client
):
    rendered = served.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    token_ids = served.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    want = grpc_client.generate(token_ids, max_tokens=1, prompt_logprobs=2).prompt_logprobs

    chat = sdk.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=1, extra_body={"prompt_logprobs": 2}
    ).to_dict()

    assert_vllm_prompt_logprobs(chat["prompt_logprobs"], token_ids, want, 2, served.tokenizer)
    assert "prompt_logprobs" not in chat["choices"][0]


def test_streamed_prompt_logprobs_come_in_the_first_chunk_as_whole(served: Served, sdk: openai.OpenAI):
    body = {"model": served.model, "prompt": [5, 6, 7, 8], "max_tokens": 3, "extra_body": {"prompt_logprobs": 1}}
    whole = sdk.completions.create(**body).to_dict()["choices"][0]["prompt_logprobs"]

    chunks = [chunk.to_dict()["choices"][0] for chunk in sdk.completions.create(stream=True, **GREEDY | body)]

    first = chunks[0]["prompt_logprobs"]
    assert list(map(list, first[1:])) == list(map(list, whole[1:])) and first[0] is None
    for streamed, entry in zip(first[1:], whole[1:], strict=True):
        expected = [value["logprob"] for value in entry.values()]
        assert [value["logprob"] for value in streamed.values()] == pytest.approx(expected, abs=1e-5)
    assert all("prompt_logprobs" not in chunk for chunk in chunks[1:])


def test_generate_prints_the_prompt_logprobs_the_grpc_api_gives(served: Served, grpc_client: Client, capsys):
    from kvserve.cli import main

    want = grpc_client.generate("hello there", max_tokens=1, prompt_logprobs=1).prompt_logprobs

    assert main(["generate", "--target", served.grpc_target, "--max-tokens", "1", "--prompt-logprobs", "1",
                 "hello there"]) == 0

    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("prompt token")]
    assert lines[0] == "prompt token 0: no logprob (nothing comes before it)"
    assert len(lines) == len(want)
    for position, (line, expected) in enumerate(zip(lines[1:], want[1:], strict=True), 1):
        [(token_id, logprob)] = zip(expected.top_token_ids, expected.top_logprobs, strict=True)
        assert line == (
            f"prompt token {position}: {expected.logprob:.4f} (likeliest there, by token id: {token_id} {logprob:.4f})"
        )


# -- n choices -------------------------------------------------------------------

# Random sampling, seeded: choice i of a request samples as one request with seed + i.
SAMPLED = {"temperature": 1.0, "seed": 1234, "max_tokens": 16, "extra_body": {"ignore_eos": True}}


def test_n_completions_are_indexed_seeded_one_by_one_and_differ(served: Served, sdk: openai.OpenAI):
    completion = sdk.completions.create(model=served.model, prompt="many ways", n=3, **SAMPLED)
    again = sdk.completions.create(model=served.model, prompt="many ways", n=3, **SAMPLED)
    second_seed = sdk.completions.create(model=served.model, prompt="many ways", **{**SAMPLED, "seed": 1235})

    texts = [choice.text for choice in completion.choices]
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    assert [choice.text for choice in again.choices] == texts
    assert len(set(texts)) == 3
    assert second_seed.choices[0].text == texts[1]
    assert all(choice.finish_reason == "length" for choice in completion.choices)


def test_the_usage_of_n_choices_counts_the_prompt_once_and_sums_the_completions(served: Served, sdk: openai.OpenAI):
    prompt = list(range(600, 600 + 3 * BLOCK_SIZE + 2))
    one = sdk.completions.create(model=served.model, prompt=prompt, max_tokens=5, **GREEDY)

    three = sdk.completions.create(model=served.model, prompt=prompt, max_tokens=5, n=3, **GREEDY)

    assert three.usage.prompt_tokens == len(prompt)
    assert three.usage.completion_tokens == 3 * 5
    assert three.usage.total_tokens == len(prompt) + 3 * 5
    # Every choice found the first request's whole blocks cached.
    assert three.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK_SIZE
    # Greedy: every choice is the one completion.
    assert [choice.text for choice in three.choices] == [one.choices[0].text] * 3


def test_streamed_n_completions_carry_their_index_and_add_up_to_the_whole_ones(served: Served, sdk: openai.OpenAI):
    whole = sdk.completions.create(model=served.model, prompt="many ways", n=3, **SAMPLED)

    *chunks, usage = sdk.completions.create(
        model=served.model, prompt="many ways", n=3, stream=True, stream_options={"include_usage": True}, **SAMPLED
    )

    assert all(len(chunk.choices) == 1 for chunk in chunks)
    by_index = {i: [c.choices[0] for c in chunks if c.choices[0].index == i] for i in range(3)}
    assert {i: "".join(c.text for c in by_index[i]) for i in range(3)} == {i: whole.choices[i].text for i in range(3)}
    for choices in by_index.values():
        assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + ["length"]
    assert usage.choices == []
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.usage.completion_tokens == whole.usage.completion_tokens == 3 * SAMPLED["max_tokens"]


def test_n_chat_answers_are_indexed_seeded_and_differ(served: Served, sdk: openai.OpenAI):
    chat = sdk.chat.completions.create(model=served.model, messages=MESSAGES, n=3, **SAMPLED)
    again = sdk.chat.completions.create(model=served.model, messages=MESSAGES, n=3, **SAMPLED)

    answers = [choice.message.content for choice in chat.choices]
    assert [choice.index for choice in chat.choices] == [0, 1, 2]
    assert [choice.message.content for choice in again.choices] == answers
    assert len(set(answers)) == 3
    assert chat.usage.prompt_tokens == len(rendered(served, MESSAGES))
    assert chat.usage.completion_tokens == 3 * SAMPLED["max_tokens"]


def test_a_streamed_chat_of_n_choices_says_each_ones_role_first_and_ends_once(served: Served, sdk: openai.OpenAI):
    whole = sdk.chat.completions.create(model=served.model, messages=MESSAGES, n=3, **SAMPLED)
    body = {
        "model": served.model, "messages": MESSAGES, "n": 3, "stream": True, "stream_options": {"include_usage": True},
        "temperature": 1.0, "seed": SAMPLED["seed"], "max_tokens": SAMPLED["max_tokens"], "ignore_eos": True,
    }

    with httpx.stream("POST", f"{served.base_url}/v1/chat/completions", json=body, timeout=TIMEOUT_S) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]

    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    *chunks, usage = [json.loads(event) for event in events[:-1]]
    for i in range(3):
        choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"][0]["index"] == i]
        assert [c["delta"].get("role") for c in choices] == ["assistant"] + [None] * (len(choices) - 1)
        assert "".join(c["delta"]["content"] or "" for c in choices) == whole.choices[i].message.content
        assert [c["finish_reason"] for c in choices][-1] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3 * SAMPLED["max_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_and_logprobs_apply_to_each_choice(served: Served, sdk: openai.OpenAI, stream):
    whole = sdk.completions.create(model=served.model, prompt="stop here", max_tokens=24, logprobs=1, **GREEDY)
    text, expected = whole.choices[0].text, whole.choices[0].logprobs
    stop = text[len(text) // 2 :][:3]

    answer = sdk.completions.create(
        model=served.model, prompt="stop here", max_tokens=24, logprobs=1, n=2, stop=stop, stream=stream, **GREEDY
    )

    chunks = [c for c in answer if c.choices] if stream else [answer]
    for i in range(2):
        choices = [c for chunk in chunks for c in chunk.choices if c.index == i]
        assert "".join(c.text for c in choices) == text[: text.index(stop)]
        assert choices[-1].finish_reason == "stop"
        tokens = [t for c in choices if c.logprobs is not None for t in c.logprobs.tokens]
        offsets = [o for c in choices if c.logprobs is not None for o in c.logprobs.text_offset]
        assert 0 < len(tokens) < 24
        assert tokens == expected.tokens[: len(tokens)]
        assert offsets == expected.text_offset[: len(tokens)]  # each choice's offsets start at 0


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("n", [MAX_CONCURRENT_REQUESTS + 1, 17])
def test_n_over_the_limit_is_a_400_in_openais_error_shape(served: Served, endpoint, n):
    body = {"model": served.model, "prompt": "x", "messages": MESSAGES, "n": n}
    body.pop("messages" if endpoint == "completions" else "prompt")

    response = httpx.post(f"{served.base_url}/v1/{endpoint}", json=body, timeout=TIMEOUT_S)

    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "n"
    assert error["message"].startswith(f"n: must be an integer in [1, {MAX_CONCURRENT_REQUESTS}], got {n}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_prompts_gets_each_prompts_own_completion(served: Served, sdk: openai.OpenAI, stream):
    # As OpenAI and vLLM answer it (lm-evaluation-harness batches so): choice k is prompt k's.
    prompts = ["Once upon a time", "The cat sat on"]
    alone = [
        sdk.completions.create(model=served.model, prompt=prompt, max_tokens=6, temperature=0, logprobs=1)
        for prompt in prompts
    ]

    batch = dict(model=served.model, prompt=prompts, max_tokens=6, temperature=0, logprobs=1)
    if stream:
        texts, tokens = ["", ""], [[], []]
        for chunk in sdk.completions.create(**batch, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                tokens[choice.index] += choice.logprobs.tokens if choice.logprobs else []
        assert texts == [a.choices[0].text for a in alone]
        assert tokens == [a.choices[0].logprobs.tokens for a in alone]
    else:
        answer = sdk.completions.create(**batch)
        assert [(c.index, c.text, c.logprobs.tokens) for c in answer.choices] == [
            (k, a.choices[0].text, a.choices[0].logprobs.tokens) for k, a in enumerate(alone)
        ]
        assert answer.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
        assert answer.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_a_batch_of_prompts_with_more_choices_than_the_server_runs_is_refused(served: Served, sdk: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=served.model, prompt=["one", "two"], n=2, max_tokens=1)

    assert info.value.body["param"] == "prompt"
    assert info.value.body["message"] == (
        f"prompt: a batch of 2 prompts with n=2 is 4 requests; this server runs at most {MAX_CONCURRENT_REQUESTS} "
        "at a time (send smaller batches)"
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_refused_for_the_limit_of_concurrent_requests_aborts_the_others(
    served: Served, sdk: openai.OpenAI, grpc_client: Client, stream
):
    busy = grpc_client.stream("busy", **LONG)
    try:
        next(busy)
        # Two choices are admitted, the third is refused: the two must not run on for 1500 tokens.
        with pytest.raises(openai.RateLimitError):
            sdk.completions.create(
                model=served.model, prompt="three", n=3, stream=stream, max_tokens=LONG["max_tokens"], **GREEDY
            )
    finally:
        busy.close()
    wait_until_idle(grpc_client, ABORT_TIMEOUT_S)


def test_leaving_a_stream_of_n_choices_aborts_them_all_and_frees_their_blocks(served: Served, grpc_client: Client):
    body = {"model": served.model, "prompt": "leave us", "stream": True, "n": 3, **LONG}
    with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body, timeout=TIMEOUT_S) as response:
        lines = response.iter_lines()
        seen: set[int] = set()
        while len(seen) < 3:
            if line := next(lines):
                seen.add(json.loads(line.removeprefix("data: "))["choices"][0]["index"])
        assert grpc_client.get_stats()[0].num_running == 3

    wait_until_idle(grpc_client, ABORT_TIMEOUT_S)
