"""``kvserve.client`` against a real server: one replica of the tiny model on the test Ray cluster."""

from __future__ import annotations

import asyncio
import pickle
import sys
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kvserve.client import AsyncClient, Client, Completion, RequestError, Usage
from kvserve.cluster.client import DEFAULT_MAX_MESSAGE_BYTES
from kvserve.cluster.config import DEFAULT_MAX_MESSAGE_BYTES as SERVER_MAX_MESSAGE_BYTES
from kvserve.cluster.config import ClusterConfig, ServerConfig
from kvserve.cluster.detokenizer import IncrementalDetokenizer
from kvserve.cluster.launcher import start_cluster
from kvserve.proto import generate_pb2, generate_pb2_grpc
from kvserve.worker.tiny_model import create_tiny_model
from kvserve.worker.tokenizer import load_tokenizer
from tests.loopback import free_port
from tests.cluster.server_thread import ServerThread, wait_until_idle

BLOCK_SIZE = 8
NUM_BLOCKS = 256
TIMEOUT_S = 60.0
GREEDY = dict(temperature=0.0, ignore_eos=True)
# Several seconds of decoding (~3 ms a token here): still running long after a test leaves its stream.
LONG = dict(max_tokens=1500, temperature=0.0, ignore_eos=True)
# How soon a left stream's request must be gone: far less than LONG takes to finish.
ABORT_TIMEOUT_S = 1.5


@dataclass
class Served:
    target: str
    model_dir: Path
    stub: generate_pb2_grpc.GenerationStub


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_dir = create_tiny_model(tmp_path_factory.mktemp("client-model"), "llama", seed=0)
    handle = start_cluster(ClusterConfig.from_kwargs(str(model_dir), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS))
    server = None
    try:
        server = ServerThread(handle, ServerConfig(port=0, stream_interval_s=0.0))
        target = f"127.0.0.1:{server.server.port}"
        with grpc.insecure_channel(target) as channel:
            yield Served(target, model_dir, generate_pb2_grpc.GenerationStub(channel))
    finally:
        if server is not None:
            server.stop()
        handle.shutdown()


@pytest.fixture
def client(served: Served) -> Iterator[Client]:
    with Client(served.target) as client:
        yield client


# -- generate and stream -------------------------------------------------------------


def test_generate_returns_what_the_grpc_api_streams(served: Served, client: Client):
    completion = client.generate("hello world", max_tokens=8, **GREEDY)

    request = generate_pb2.GenerateRequest(
        text="hello world", sampling_params=generate_pb2.SamplingParams(max_tokens=8, **GREEDY)
    )
    responses = list(served.stub.Generate(request, timeout=TIMEOUT_S))
    assert isinstance(completion, Completion)
    assert completion.text == "".join(r.text for r in responses)
    assert completion.token_ids == tuple(t for r in responses for t in r.token_ids)
    assert len(completion.token_ids) == 8
    assert completion.finish_reason == "length"
    assert completion.replica == 0
    assert completion.request_id


def test_generate_reports_the_usage(served: Served, client: Client):
    prompt = "the usage of a request"
    num_prompt_tokens = len(load_tokenizer(served.model_dir)(prompt)["input_ids"])

    completion = client.generate(prompt, max_tokens=5, **GREEDY)

    assert completion.usage == Usage(prompt_tokens=num_prompt_tokens, completion_tokens=5, cached_prompt_tokens=0)


def test_a_repeated_prompt_reports_its_cached_prompt_tokens(client: Client):
    prompt = list(range(200, 200 + 3 * BLOCK_SIZE + 2))
    first = client.generate(prompt, max_tokens=2, **GREEDY)
    second = client.generate(prompt, max_tokens=2, **GREEDY)

    assert first.usage.cached_prompt_tokens == 0
    assert second.usage.cached_prompt_tokens == 3 * BLOCK_SIZE
    assert second.usage.prompt_tokens == len(prompt)


def test_the_deltas_of_a_stream_add_up_to_the_completion(client: Client):
    completion = client.generate("stream me", max_tokens=12, **GREEDY)

    deltas = list(client.stream("stream me", max_tokens=12, **GREEDY))

    assert "".join(d.text for d in deltas) == completion.text
    assert tuple(t for d in deltas for t in d.token_ids) == completion.token_ids
    assert len(deltas) > 1
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert all(d.usage is None for d in deltas[:-1])
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].usage == completion.usage


def test_the_deltas_logprobs_add_up_to_the_completions(client: Client):
    completion = client.generate("stream me", max_tokens=12, logprobs=2, **GREEDY)

    deltas = list(client.stream("stream me", max_tokens=12, logprobs=2, **GREEDY))

    assert len(completion.logprobs) == len(completion.token_ids) == 12
    assert tuple(t for d in deltas for t in d.logprobs or ()) == completion.logprobs
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas if d.token_ids)
    # Greedy: each token is the most likely one at its position.
    assert [t.top_token_ids[0] for t in completion.logprobs] == list(completion.token_ids)
    assert all(t.logprob == t.top_logprobs[0] and len(t.top_token_ids) == 2 for t in completion.logprobs)


def test_a_completion_that_did_not_ask_has_no_logprobs(client: Client):
    assert client.generate("plain", max_tokens=3, **GREEDY).logprobs is None


def test_a_stop_token_ends_the_completion_with_reason_stop(client: Client):
    tokens = client.generate("stop here", max_tokens=6, **GREEDY).token_ids

    completion = client.generate("stop here", max_tokens=6, stop_token_ids=[tokens[2]], **GREEDY)

    assert completion.finish_reason == "stop"
    assert completion.token_ids == tokens[: tokens.index(tokens[2]) + 1]


def test_a_stop_string_ends_the_completion_and_is_not_sent(served: Served, client: Client):
    whole = client.generate("stop strings", max_tokens=24, **GREEDY)
    stop = whole.text[len(whole.text) // 2 :][:3]
    # The tokens up to the one whose text, as the server streams it, completes the stop string.
    detokenizer = IncrementalDetokenizer(load_tokenizer(served.model_dir))
    streamed = ""
    for num_tokens, token_id in enumerate(whole.token_ids, start=1):
        streamed += detokenizer.add([token_id])
        if stop in streamed:
            break

    completion = client.generate("stop strings", max_tokens=24, stop=[stop], **GREEDY)

    assert completion.text == whole.text[: whole.text.index(stop)]
    assert completion.finish_reason == "stop"
    assert completion.token_ids == whole.token_ids[:num_tokens]
    assert completion.usage.completion_tokens == num_tokens
    assert completion.usage.prompt_tokens == whole.usage.prompt_tokens
    wait_until_idle(client, ABORT_TIMEOUT_S)


def test_a_streamed_stop_string_is_held_back_until_it_is_known(client: Client):
    whole = client.generate("held back", max_tokens=24, **GREEDY)
    stop = whole.text[len(whole.text) // 2 :][:4]

    deltas = list(client.stream("held back", max_tokens=24, stop=stop, **GREEDY))

    assert "".join(d.text for d in deltas) == whole.text[: whole.text.index(stop)]
    assert deltas[-1].finish_reason == "stop"


def test_a_stop_string_never_produced_changes_nothing(client: Client):
    whole = client.generate("no stop", max_tokens=8, **GREEDY)

    completion = client.generate("no stop", max_tokens=8, stop=["\u2603 never"], **GREEDY)

    assert completion.text == whole.text
    assert completion.finish_reason == "length"


def test_request_fields_reach_the_server(client: Client):
    completion = client.generate("named", max_tokens=1, request_id="my-request-1", cache_salt="tenant-a")

    assert completion.request_id == "my-request-1"


def test_leaving_a_stream_early_aborts_its_request_and_frees_its_blocks(client: Client):
    stream = client.stream("leave me", **LONG)
    next(stream)
    assert client.get_stats()[0].num_running == 1

    stream.close()

    wait_until_idle(client, ABORT_TIMEOUT_S)


def test_an_async_client_generates_what_the_blocking_one_does(served: Served, client: Client):
    prompts = [f"prompt number {i}" for i in range(4)]
    expected = [client.generate(p, max_tokens=6, **GREEDY).text for p in prompts]

    async def generate_all() -> list[Completion]:
        async with AsyncClient(served.target) as async_client:
            return await asyncio.gather(*(async_client.generate(p, max_tokens=6, **GREEDY) for p in prompts))

    completions = asyncio.run(generate_all())
    assert [c.text for c in completions] == expected
    assert all(c.usage.completion_tokens == 6 for c in completions)


def test_an_async_stream_yields_deltas_and_leaving_it_frees_the_request(served: Served, client: Client):
    async def first_delta_then_leave() -> tuple[str, int]:
        async with AsyncClient(served.target) as async_client:
            stream = async_client.stream("async leave", **LONG)
            delta = await anext(stream)
            running = (await async_client.get_stats())[0].num_running
            await stream.aclose()
            return delta.request_id, running

    request_id, running = asyncio.run(first_delta_then_leave())
    assert request_id
    assert running == 1
    wait_until_idle(client, ABORT_TIMEOUT_S)


def test_an_expired_deadline_is_deadline_exceeded_and_frees_the_request(client: Client):
    with pytest.raises(RequestError) as info:
        client.generate("too slow", timeout=0.3, **LONG)

    assert info.value.code == "DEADLINE_EXCEEDED"
    wait_until_idle(client, ABORT_TIMEOUT_S)


def test_cancelling_an_async_generate_aborts_its_request(served: Served, client: Client):
    async def cancel_then_wait() -> None:
        async with AsyncClient(served.target) as async_client:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(async_client.generate("cancel me", **LONG), 0.3)
            # With the channel still open: the cancelled call alone ended the request.
            wait_until_idle(client, ABORT_TIMEOUT_S)

    asyncio.run(cancel_then_wait())


def test_closing_an_async_stream_before_reading_it_leaves_nothing_running(served: Served, client: Client):
    async def open_then_close() -> None:
        async with AsyncClient(served.target) as async_client:
            stream = async_client.stream("never read", **LONG)
            await asyncio.sleep(0.2)
            await stream.aclose()
            # With the channel still open: closing the stream alone must end its request.
            wait_until_idle(client, ABORT_TIMEOUT_S)

    asyncio.run(open_then_close())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="a task tells grpc's CancelledError from its own from 3.11")
def test_closing_an_async_client_under_a_stream_ends_it_with_a_request_error(served: Served, client: Client):
    # The consumer got asyncio.CancelledError though nobody cancelled its task (which then ended as
    # cancelled, past its `except Exception`); the blocking Client raises RequestError("CANCELLED") here.
    async def consume(stream) -> BaseException | None:  # noqa: ANN001
        try:
            async for _ in stream:
                pass
        except Exception as exc:  # noqa: BLE001 - what a consumer of the stream would catch
            return exc
        return None

    async def close_under_it() -> BaseException | None:
        async_client = AsyncClient(served.target)
        stream = async_client.stream("closed under me", **LONG)
        consumer = asyncio.create_task(consume(stream))
        while not (await async_client.get_stats())[0].num_running:
            await asyncio.sleep(0.05)
        await async_client.close()
        return await consumer

    error = asyncio.run(close_under_it())
    assert isinstance(error, RequestError) and error.code == "CANCELLED"
    assert error.message == "the client was closed while the call was in flight"
    wait_until_idle(client, ABORT_TIMEOUT_S)


# -- errors ----------------------------------------------------------------------


def test_invalid_values_are_invalid_argument_naming_the_field(client: Client):
    with pytest.raises(RequestError) as info:
        client.generate("hello", top_p=2.0)

    assert info.value.code == "INVALID_ARGUMENT"
    assert "top_p" in info.value.message


def test_logprobs_past_the_limit_are_invalid_argument_naming_the_field(client: Client):
    with pytest.raises(RequestError) as info:
        client.generate("hello", logprobs=21)

    assert info.value.code == "INVALID_ARGUMENT"
    assert info.value.message.startswith("sampling_params.logprobs must be an integer in [0, 20]")


def test_an_async_client_raises_the_same_error(served: Served):
    async def generate() -> None:
        async with AsyncClient(served.target) as async_client:
            await async_client.generate("hello", max_tokens=0)

    with pytest.raises(RequestError) as info:
        asyncio.run(generate())
    assert info.value.code == "INVALID_ARGUMENT"
    assert "max_tokens" in info.value.message


def test_no_server_is_unavailable():
    with Client(f"127.0.0.1:{free_port()}") as client, pytest.raises(RequestError) as info:
        client.generate("hello", timeout=5)
    assert info.value.code == "UNAVAILABLE"


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"max_token": 4}, TypeError, "unexpected keyword argument 'max_token' (did you mean 'max_tokens'?)"),
        ({"stpo": ["\n"]}, TypeError, "unexpected keyword argument 'stpo' (did you mean 'stop'?)"),
        ({"stop": 3}, TypeError, "stop must be a string or a sequence of strings, got 3"),
        ({"top_p": "high"}, TypeError, "top_p: "),
        ({"ignore_eos": 1}, TypeError, "ignore_eos must be True or False, got 1"),
        ({"stop_token_ids": 5}, TypeError, "stop_token_ids must be a sequence of token ids, got 5"),
        ({"max_tokens": 2**40}, ValueError, "max_tokens: "),
        ({"timeout": 0}, ValueError, "timeout must be a positive number of seconds or None, got 0"),
    ],
)
def test_bad_keywords_fail_before_anything_is_sent(kwargs, error, message):
    # Nobody listens at the target: an error from the server would be UNAVAILABLE.
    with Client(f"127.0.0.1:{free_port()}") as client:
        with pytest.raises(error) as info:
            client.stream("hello", **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("prompt", [3.5, b"bytes", None])
def test_a_prompt_that_is_neither_text_nor_token_ids_is_a_type_error(prompt):
    with Client(f"127.0.0.1:{free_port()}") as client, pytest.raises(TypeError, match="prompt must be a str"):
        client.stream(prompt)


def test_a_missing_ca_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="tls_ca: cannot read .*missing.pem: No such file"):
        Client("127.0.0.1:1", tls_ca=tmp_path / "missing.pem")


def test_a_ca_file_without_a_certificate_is_a_clear_error(tmp_path):
    not_a_certificate = tmp_path / "ca.pem"
    not_a_certificate.write_text("not a certificate\n")

    with pytest.raises(ValueError, match=r"tls_ca: .*ca.pem: holds no certificate \(expected PEM CA certificates\)"):
        Client("127.0.0.1:1", tls_ca=not_a_certificate)


@pytest.mark.parametrize(
    "target, error, message",
    [
        ("", ValueError, "target: expected HOST:PORT with a port in 1..65535, got ''"),
        # grpc would take port 443.
        ("127.0.0.1", ValueError, "target: expected HOST:PORT with a port in 1..65535, got '127.0.0.1'"),
        ("http://127.0.0.1:50051", ValueError, "target: expected the server's HOST:PORT, not a URL"),
        ("unix:", ValueError, "target: expected an address after 'unix:', got 'unix:'"),
        ("dns:///", ValueError, "target: expected an address after 'dns:', got 'dns:///'"),
        (None, TypeError, "target must be a str such as '127.0.0.1:50051', got NoneType"),
    ],
)
def test_a_target_that_is_no_address_is_refused_when_the_client_is_made(target, error, message):
    with pytest.raises(error) as info:
        Client(target)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "target", ["localhost:50051", "[::1]:50051", "dns:///localhost:50051", "unix:/tmp/kvserve.sock"]
)
def test_a_target_of_host_and_port_or_of_a_grpc_scheme_is_taken(target):
    Client(target).close()


def test_a_closed_client_refuses_calls_saying_so():
    client = Client(f"127.0.0.1:{free_port()}")
    client.close()

    for call in (lambda: client.generate("hello"), client.get_stats):
        with pytest.raises(RuntimeError, match="this Client is closed"):
            call()


def test_a_closed_async_client_refuses_calls_saying_so():
    async def call_after_close() -> None:
        async_client = AsyncClient(f"127.0.0.1:{free_port()}")
        await async_client.close()
        with pytest.raises(RuntimeError, match="this AsyncClient is closed"):
            await async_client.generate("hello")
        with pytest.raises(RuntimeError, match="this AsyncClient is closed"):
            await async_client.get_stats()

    asyncio.run(call_after_close())


def test_an_async_client_made_outside_an_event_loop_is_refused():
    with pytest.raises(RuntimeError, match="AsyncClient must be made inside the event loop that uses it"):
        AsyncClient("127.0.0.1:1")


def test_an_async_client_used_from_another_event_loop_is_refused():
    async def make() -> AsyncClient:
        return AsyncClient(f"127.0.0.1:{free_port()}")

    async_client = asyncio.run(make())

    with pytest.raises(RuntimeError, match="belongs to the event loop it was made in"):
        asyncio.run(async_client.get_stats())


def test_a_request_error_survives_pickling_as_a_process_pool_or_ray_task_sends_it():
    error = pickle.loads(pickle.dumps(RequestError("UNAVAILABLE", "no replica is healthy")))

    assert (error.code, error.message, str(error)) == (
        "UNAVAILABLE", "no replica is healthy", "UNAVAILABLE: no replica is healthy"
    )


def test_the_client_limits_messages_as_the_server_does():
    assert DEFAULT_MAX_MESSAGE_BYTES == SERVER_MAX_MESSAGE_BYTES


# -- authentication ----------------------------------------------------------------


class RecordingGeneration(generate_pb2_grpc.GenerationServicer):
    """Answers every call with one final message and keeps each call's metadata."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []

    def Generate(self, request, context):  # noqa: N802 - the servicer's method name
        self.metadata.append(dict(context.invocation_metadata()))
        yield generate_pb2.GenerateResponse(
            request_id="r", token_ids=[1], text="x", finish_reason=generate_pb2.FINISH_REASON_LENGTH
        )


@pytest.fixture
def recording_server() -> Iterator[tuple[str, RecordingGeneration]]:
    servicer = RecordingGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(None)


def test_a_token_is_sent_as_a_bearer_authorization_header(recording_server):
    target, servicer = recording_server
    with Client(target, token="s3cret") as client:
        client.generate("hello")

    assert servicer.metadata[-1]["authorization"] == "Bearer s3cret"


def test_without_a_token_no_authorization_header_is_sent(recording_server):
    target, servicer = recording_server
    with Client(target) as client:
        client.generate("hello")

    assert "authorization" not in servicer.metadata[-1]


@pytest.mark.parametrize("token", ["", "two words", "line\nbreak", "naïve"])
def test_a_token_that_cannot_be_a_header_is_refused(token):
    with pytest.raises(ValueError, match="token must be a non-empty string of printable ASCII"):
        Client("127.0.0.1:1", token=token)

