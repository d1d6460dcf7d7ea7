"""vLLM's ``min_p`` through every front door: the gRPC API and the Python client, both OpenAI endpoints
(an extra body field) and ``kvserve generate --min-p``; what each sends, the ``SamplingParams`` the
request is scheduled with, and how a bad value is refused (naming the field).

The front ends are real (``Frontend``, the OpenAI app, the CLI); the scheduler is the recording fake of
the penalties' tests and the CLI's server a stand-in that records what it is sent.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from kvserve.cli import main
from kvserve.cluster.cli_generate import in_argument_terms
from kvserve.cluster.client_messages import KEYWORDS, to_generate_request
from kvserve.cluster.frontend import Frontend
from kvserve.cluster.frontend_errors import InvalidRequestError
from kvserve.cluster.request_conversion import RequestConversion
from kvserve.cluster.request_limits import RequestLimits
from kvserve.proto import generate_pb2
from kvserve.scheduler.sampling_params import SamplingParams
from tests.cluster.test_frontend_streaming import MODEL_INFO, Aborted, FakeContext
from tests.cluster.test_sampling_penalties_cli import sent, servicer  # noqa: F401 - servicer is a fixture
from tests.cluster.test_sampling_penalties_openai import RecordingScheduler, chat, complete, refusal


@pytest.fixture(scope="module")
def conversion() -> RequestConversion:
    return RequestConversion(MODEL_INFO, None, RequestLimits())


def generate(min_p: float, scheduler: RecordingScheduler) -> list[generate_pb2.GenerateResponse]:
    """The messages of one gRPC ``Generate`` call with ``min_p``, through a real front end over ``scheduler``."""
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=[5, 6, 7]),
        sampling_params=generate_pb2.SamplingParams(max_tokens=8, temperature=0.7, min_p=min_p),
    )

    async def run() -> list[generate_pb2.GenerateResponse]:
        frontend = Frontend(scheduler, MODEL_INFO, None, max_concurrent_requests=8)
        frontend.start()
        try:
            return [message async for message in frontend.Generate(request, FakeContext())]
        finally:
            await frontend.stop()

    return asyncio.run(run())


# -- gRPC and the client ---------------------------------------------------------------------


def test_a_grpc_requests_min_p_is_scheduled_with_it():
    scheduler = RecordingScheduler()

    messages = generate(0.1, scheduler)

    [spec] = scheduler.specs

    assert messages[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert spec.sampling_params == SamplingParams(max_tokens=8, temperature=0.7, min_p=0.1)


@pytest.mark.parametrize("min_p", [0.0, 1e-300, 0.05, 1 / 3, 1.0])
def test_any_min_p_from_0_to_1_arrives_exactly(conversion, min_p):
    params = conversion.to_sampling_params(generate_pb2.SamplingParams(min_p=min_p))

    assert params.min_p == min_p


def test_an_unset_min_p_is_none(conversion):
    assert conversion.to_sampling_params(generate_pb2.SamplingParams()).min_p == 0.0


@pytest.mark.parametrize(
    "min_p, message",
    [
        (1.5, "sampling_params.min_p must be in [0, 1], got 1.5"),
        (-0.25, "sampling_params.min_p must be in [0, 1], got -0.25"),
        (math.nan, "sampling_params.min_p must be in [0, 1], got nan"),
        (math.inf, "sampling_params.min_p must be in [0, 1], got inf"),
    ],
)
def test_a_min_p_out_of_range_is_refused_naming_the_field(conversion, min_p, message):
    with pytest.raises(InvalidRequestError) as info:
        conversion.to_sampling_params(generate_pb2.SamplingParams(min_p=min_p))

    assert str(info.value) == message


def test_a_grpc_call_with_a_bad_min_p_ends_invalid_argument_and_schedules_nothing():
    scheduler = RecordingScheduler()

    with pytest.raises(Aborted, match=r": sampling_params\.min_p must be in \[0, 1\], got 2\.0$") as info:
        generate(2.0, scheduler)

    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert not scheduler.specs


def test_what_the_client_sends_is_what_the_server_samples_with(conversion):
    request = to_generate_request([5, 6], {"max_tokens": 4, "top_p": 0.9, "min_p": 0.125})

    assert request.sampling_params.min_p == 0.125
    assert conversion.to_request_spec(request).sampling_params == SamplingParams(max_tokens=4, top_p=0.9,
                                                                                 min_p=0.125)


def test_the_client_leaves_min_p_unset_unless_given():
    assert "min_p" in KEYWORDS
    assert not to_generate_request("hi", {"max_tokens": 4}).sampling_params.HasField("min_p")
    assert not to_generate_request("hi", {"min_p": None}).sampling_params.HasField("min_p")


@pytest.mark.parametrize("value, message", [(True, "min_p must be a number, got True"), ("0.1", "min_p: ")])
def test_a_min_p_of_the_wrong_type_fails_in_the_client(value, message):
    with pytest.raises(TypeError) as info:
        to_generate_request("hi", {"min_p": value})

    assert str(info.value).startswith(message)


# -- the OpenAI endpoints ----------------------------------------------------------------------


def test_a_completion_bodys_min_p_reaches_its_sampling_params():
    response, [spec] = complete(temperature=0.8, min_p=0.1)

    assert response.status_code == 200, response.text
    assert spec.sampling_params == SamplingParams(max_tokens=8, temperature=0.8, min_p=0.1)


def test_a_chat_bodys_min_p_reaches_its_sampling_params():
    response, [spec] = chat(max_completion_tokens=6, min_p=0.05)

    assert response.status_code == 200, response.text
    assert spec.sampling_params == SamplingParams(max_tokens=6, min_p=0.05)


def test_a_null_min_p_is_none():
    response, [spec] = complete(min_p=None)

    assert response.status_code == 200, response.text
    assert spec.sampling_params.min_p == 0.0


@pytest.mark.parametrize(
    "min_p, message",
    [
        (1.5, "min_p must be in [0, 1], got 1.5"),
        (-0.1, "min_p must be in [0, 1], got -0.1"),
        (1e400, "min_p must be in [0, 1], got inf"),
        ("0.1", "min_p: Input should be a valid number"),
        (True, "min_p: Input should be a valid number"),
    ],
)
def test_a_bad_min_p_is_a_400_naming_it(min_p, message):
    for response, specs in (complete(min_p=min_p), chat(min_p=min_p)):
        error = refusal(response)
        assert (error["param"], error["message"]) == ("min_p", message)
        assert not specs


# -- kvserve generate ----------------------------------------------------------------------------


def test_the_min_p_flag_is_sent_in_its_field(servicer):  # noqa: F811 - the fixture
    assert sent(servicer, "--min-p", "0.2").min_p == 0.2
    assert not sent(servicer).HasField("min_p")


def test_a_min_p_flag_that_is_not_a_number_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--min-p", "low"])

    assert exit_info.value.code == 2
    assert "argument --min-p: invalid float value: 'low'" in capsys.readouterr().err


def test_the_servers_refusal_of_min_p_names_the_flag():
    assert in_argument_terms("sampling_params.min_p must be in [0, 1], got 1.5") == "--min-p must be in [0, 1], got 1.5"
