"""Prompt logprobs through the gRPC API and the Python client: ``sampling_params.prompt_logprobs`` in,
``GenerateResponse.prompt_logprobs`` out on the first message that carries tokens, and on no other.

The front end runs in process over the fake scheduler of test_frontend_streaming; the client talks to
it over a real in-process gRPC server.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvserve.client import AsyncClient, TokenLogprobs
from kvserve.cluster.client_messages import CompletionBuilder, to_delta, to_generate_request
from kvserve.cluster.frontend import Frontend, InvalidRequestError
from kvserve.cluster.messages import RequestDelta
from kvserve.cluster.output_stream import OutputStream, StreamPacing
from kvserve.cluster.request_conversion import RequestConversion, to_response
from kvserve.cluster.request_limits import RequestLimits
from kvserve.proto import generate_pb2, generate_pb2_grpc
from kvserve.scheduler.sampling_params import SamplingParams
from tests.cluster.test_frontend_streaming import MODEL_INFO, FakeContext, FakeScheduler
from tests.cluster.test_sampling_penalties_stop_strings import Letters, ids

PROMPT = [2, 3, 4]
# What the scheduler gives a request of PROMPT that asked: one entry per prompt token, the first None.
PROMPT_LOGPROBS = [None, TokenLogprobs(-1.5, (4, 0), (-0.5, -1.0)), TokenLogprobs(-2.25, (1, 4), (-0.75, -2.25))]
# The same on the wire: the first prompt token's entry left out.
WIRE = [
    generate_pb2.TokenLogprobs(
        logprob=-1.5, top_logprobs=[generate_pb2.TopLogprob(token_id=4, logprob=-0.5),
                                    generate_pb2.TopLogprob(token_id=0, logprob=-1.0)]
    ),
    generate_pb2.TokenLogprobs(
        logprob=-2.25, top_logprobs=[generate_pb2.TopLogprob(token_id=1, logprob=-0.75),
                                     generate_pb2.TopLogprob(token_id=4, logprob=-2.25)]
    ),
]


def conversion() -> RequestConversion:
    return RequestConversion(MODEL_INFO, None, RequestLimits())


# -- conversion ------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 3, 20])
def test_sampling_params_prompt_logprobs_becomes_the_requests(k):
    params = conversion().to_sampling_params(generate_pb2.SamplingParams(prompt_logprobs=k, logprobs=1))

    assert params == SamplingParams(prompt_logprobs=k, logprobs=1)


def test_unset_prompt_logprobs_asks_for_none():
    assert conversion().to_sampling_params(generate_pb2.SamplingParams()).prompt_logprobs is None


@pytest.mark.parametrize("k", [-1, 21])
def test_prompt_logprobs_out_of_range_is_refused_naming_the_field(k):
    with pytest.raises(InvalidRequestError) as info:
        conversion().to_sampling_params(generate_pb2.SamplingParams(prompt_logprobs=k))

    assert str(info.value) == f"sampling_params.prompt_logprobs must be an integer in [0, 20], got {k}"


def test_a_delta_with_prompt_logprobs_is_a_response_with_one_per_prompt_token_after_the_first():
    response = to_response("r", RequestDelta("r", [7], replica=0, prompt_logprobs=PROMPT_LOGPROBS), None)

    assert list(response.prompt_logprobs) == WIRE
    assert list(response.token_ids) == [7] and not response.logprobs


def test_a_delta_without_them_and_a_one_token_prompts_have_none_on_the_wire():
    assert not to_response("r", RequestDelta("r", [7], replica=0), None).prompt_logprobs
    assert not to_response("r", RequestDelta("r", [7], replica=0, prompt_logprobs=[None]), None).prompt_logprobs


# -- the pipeline ----------------------------------------------------------------------------------


def generate(
    *deltas: RequestDelta, stop: list[str] = (), tokenizer=None, **options
) -> list[generate_pb2.GenerateResponse]:
    """A request of ``PROMPT`` that asks for prompt logprobs, its scheduler producing ``deltas`` (one batch)."""
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=PROMPT),
        sampling_params=generate_pb2.SamplingParams(max_tokens=8, stop=stop, prompt_logprobs=2),
        request_id="r",
    )

    async def run() -> list[generate_pb2.GenerateResponse]:
        scheduler = FakeScheduler()
        frontend = Frontend(scheduler, MODEL_INFO, tokenizer, max_concurrent_requests=4, **options)
        frontend.start()
        try:
            responses = asyncio.ensure_future(collect(frontend.Generate(request, FakeContext())))
            while not scheduler.added:
                await asyncio.sleep(0.005)
            for delta in deltas:
                scheduler.emit(delta)
                await asyncio.sleep(0.02)  # a poll each
            return await responses
        finally:
            await frontend.stop()

    return asyncio.run(run())


async def collect(responses) -> list[generate_pb2.GenerateResponse]:
    return [response async for response in responses]


FIRST = RequestDelta("r", [1, 2], replica=0, prompt_logprobs=PROMPT_LOGPROBS)
LAST = RequestDelta("r", [3], finish_reason="length", num_prompt_tokens=3, num_output_tokens=3, replica=0)


def test_the_first_message_carries_the_prompt_logprobs_and_no_other_does():
    responses = generate(FIRST, RequestDelta("r", [4], replica=0), LAST)

    assert [list(r.token_ids) for r in responses] == [[1, 2], [4], [3]]
    assert [list(r.prompt_logprobs) for r in responses] == [WIRE, [], []]


def test_tokens_held_for_the_stream_interval_travel_with_them_once():
    # The first tokens go out at once; the others, and the end, wait for the interval.
    responses = generate(FIRST, RequestDelta("r", [4], replica=0), LAST, stream_interval_s=0.5)

    assert sum(len(r.prompt_logprobs) for r in responses) == len(WIRE)
    assert list(responses[0].prompt_logprobs) == WIRE and list(responses[0].token_ids) == [1, 2]


def test_a_request_that_ends_with_its_first_tokens_gets_them_on_its_one_message():
    responses = generate(FIRST, LAST)  # one poll may take both: then they are one message

    assert [list(r.prompt_logprobs) for r in responses][0] == WIRE
    assert sum(len(r.prompt_logprobs) for r in responses) == len(WIRE)
    assert responses[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH


def test_a_stop_string_that_cuts_the_first_message_keeps_them():
    # Letters: tokens 0 1 2 are "a" "b" "c"; the stop string "bc" ends in the first message's third token.
    first = RequestDelta("r", ids("abca"), replica=0, prompt_logprobs=PROMPT_LOGPROBS)

    responses = generate(first, RequestDelta("r", ids("b"), replica=0), stop=["bc"], tokenizer=Letters())

    [response] = responses
    assert (response.text, list(response.token_ids)) == ("a", ids("abc"))
    assert response.finish_reason == generate_pb2.FINISH_REASON_STOP
    assert list(response.prompt_logprobs) == WIRE


def test_an_output_stream_merges_them_into_the_last_delta_once():
    async def run() -> list[RequestDelta]:
        stream = OutputStream("r", StreamPacing(0.0, None))
        stream.add([1], 0, prompt_logprobs=PROMPT_LOGPROBS)
        stream.add([2], 0)
        stream.end(LAST)
        return [await stream.next_message()]

    [message] = asyncio.run(run())

    assert (message.token_ids, message.prompt_logprobs, message.is_last) == ([1, 2, 3], PROMPT_LOGPROBS, True)


# -- the Python client -----------------------------------------------------------------------------


def test_the_client_sends_prompt_logprobs_as_a_keyword():
    request = to_generate_request([2, 3], {"prompt_logprobs": 5, "logprobs": 1})

    assert request.sampling_params.prompt_logprobs == 5
    assert request.sampling_params.HasField("prompt_logprobs")


def test_the_clients_first_delta_and_completion_have_one_entry_per_prompt_token():
    first = generate_pb2.GenerateResponse(request_id="r", token_ids=[1], prompt_logprobs=WIRE, replica=0)
    last = generate_pb2.GenerateResponse(
        request_id="r", token_ids=[2], replica=0, finish_reason=generate_pb2.FINISH_REASON_LENGTH
    )
    builder = CompletionBuilder()

    deltas = [to_delta(first, with_prompt_logprobs=True), to_delta(last)]
    for delta in deltas:
        builder.add(delta)

    assert [delta.prompt_logprobs for delta in deltas] == [tuple(PROMPT_LOGPROBS), None]
    assert builder.build().prompt_logprobs == tuple(PROMPT_LOGPROBS)


def test_a_client_that_does_not_ask_gets_none():
    response = generate_pb2.GenerateResponse(request_id="r", token_ids=[1], replica=0)

    assert to_delta(response).prompt_logprobs is None


def test_the_async_client_gets_them_from_a_server_once():
    async def run():
        scheduler = FakeScheduler()
        frontend = Frontend(scheduler, MODEL_INFO, None, max_concurrent_requests=4)
        frontend.start()
        server = grpc.aio.server()
        generate_pb2_grpc.add_GenerationServicer_to_server(frontend, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with AsyncClient(f"127.0.0.1:{port}") as client:
                deltas = []

                async def read() -> None:
                    async for delta in client.stream(PROMPT, max_tokens=3, prompt_logprobs=2, request_id="r"):
                        deltas.append(delta)

                reading = asyncio.ensure_future(read())
                while not scheduler.added:
                    await asyncio.sleep(0.005)
                scheduler.emit(FIRST)
                await asyncio.sleep(0.05)
                scheduler.emit(LAST)
                await reading
                # A request that does not ask: none on its completion.
                generating = asyncio.ensure_future(client.generate(PROMPT, max_tokens=1, request_id="p"))
                while len(scheduler.added) < 2:
                    await asyncio.sleep(0.005)
                scheduler.emit(RequestDelta("p", [5], finish_reason="length", num_output_tokens=1, replica=0))
                return deltas, await generating
        finally:
            await server.stop(None)
            await frontend.stop()

    deltas, plain_completion = asyncio.run(run())

    assert [delta.prompt_logprobs for delta in deltas] == [tuple(PROMPT_LOGPROBS), None]
    assert plain_completion.prompt_logprobs is None
