"""The whole cluster over real gRPC: 2 replicas x TP 2 on the two simulated Ray nodes.

One cluster and one server serve every test of this module, in file order;
the tests that kill a worker and shut the cluster down run last.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvserve import LLM, SamplingParams
from kvserve.cluster.config import ClusterConfig, ServerConfig
from kvserve.scheduler.engine_config import ParallelConfig
from kvserve.cluster.launcher import ClusterHandle, start_cluster
from kvserve.cluster.messages import RequestSpec
from kvserve.cluster.scheduler_actor import SCHEDULER_ACTOR_NAME
from kvserve.cluster.server import GENERATION_SERVICE, start_server
from kvserve.cluster.worker_actor import RAY_NAMESPACE, worker_actor_name
from kvserve.proto import generate_pb2, generate_pb2_grpc
from kvserve.worker.tiny_model import create_tiny_model
from tests.cluster.server_thread import ServerThread

NUM_REPLICAS = 2
TP_SIZE = 2
BLOCK_SIZE = 8
NUM_BLOCKS = 128
MAX_NUM_BATCHED_TOKENS = 64
MAX_NUM_SEQS = 16
NUM_STREAMS = 32
# The 33rd stream in flight is refused.
MAX_CONCURRENT_REQUESTS = NUM_STREAMS
# Long enough to still be running when a test cancels it, short enough to fit
# a replica's pool (127 usable blocks of 8 tokens).
LONG = generate_pb2.SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
RPC_TIMEOUT_S = 60.0
# How long the scheduler keeps outputs that no front end fetches.
UNDELIVERED_OUTPUT_TIMEOUT_S = 2.0
# Several steps per message (a step takes ~15 ms here); `kvserve serve` in
# test_cli.py streams every step.
STREAM_INTERVAL_S = 0.05


@dataclass
class Served:
    handle: ClusterHandle
    server: ServerThread
    stub: generate_pb2_grpc.GenerationStub
    channel: grpc.Channel
    model_dir: Path
    overlapped: bool


# A window under the model's 2048 positions (Mistral 7B v0.1's kind of config): the
# replicas serve up to it, and start only if the scheduler actor tells their workers so.
SLIDING_WINDOW = 1536


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("e2e-model"), "mistral", seed=0, sliding_window=SLIDING_WINDOW)


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "overlapped"])
def served(request, ray_cluster, model_dir: Path) -> Iterator[Served]:
    """The cluster, scheduling plainly or overlapped (async scheduling: each replica sends
    step N+1 before step N's samples came back): every test holds in both."""
    config = ClusterConfig.from_kwargs(
        str(model_dir),
        async_scheduling=request.param,
        parallel=ParallelConfig(tensor_parallel_size=TP_SIZE, num_replicas=NUM_REPLICAS),
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        undelivered_output_timeout_s=UNDELIVERED_OUTPUT_TIMEOUT_S,
        # The tests below count on requests alternating between the replicas;
        # test_routing.py covers the prefix-aware policies.
        routing="round_robin",
    )
    handle = start_cluster(config)
    server = None
    try:
        server_config = ServerConfig(
            port=0, max_concurrent_requests=MAX_CONCURRENT_REQUESTS, stream_interval_s=STREAM_INTERVAL_S
        )
        server = ServerThread(handle, server_config)
        with grpc.insecure_channel(f"127.0.0.1:{server.server.port}") as channel:
            yield Served(
                handle, server, generate_pb2_grpc.GenerationStub(channel), channel, model_dir, request.param
            )
    finally:
        if server is not None:
            server.stop()
        handle.shutdown()


def request(
    prompt: str | list[int], params: generate_pb2.SamplingParams | None = None, **fields
) -> generate_pb2.GenerateRequest:
    if isinstance(prompt, str):
        return generate_pb2.GenerateRequest(text=prompt, sampling_params=params, **fields)
    return generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt), sampling_params=params, **fields)


def get_stats(served: Served) -> list[generate_pb2.ReplicaStats]:
    return list(served.stub.GetStats(generate_pb2.GetStatsRequest(), timeout=RPC_TIMEOUT_S).replicas)


def wait_until_pools_are_full(served: Served, timeout_s: float = 5.0) -> list[generate_pb2.ReplicaStats]:
    """Every healthy replica idle, with every block back in its pool.

    NOTE: a ``LONG`` request runs for over 10 s here, so a request that was
    not aborted is still running when this gives up.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        stats = get_stats(served)
        healthy = [s for s in stats if s.healthy]
        if all(s.kv_cache_usage == 0 and s.num_running == 0 and s.num_waiting == 0 for s in healthy):
            return stats
        if time.monotonic() > deadline:
            pytest.fail(f"pools still in use after {timeout_s} s: {stats}")
        time.sleep(0.05)


def collect(call) -> list[generate_pb2.GenerateResponse]:
    return list(call)


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        collect(call)
    return info.value


# -- serving -------------------------------------------------------------------


def test_a_sliding_window_bounds_what_the_cluster_serves(served: Served):
    assert served.handle.model_info.max_model_len == SLIDING_WINDOW


def test_health_reports_serving(served: Served):
    health = health_pb2_grpc.HealthStub(served.channel)
    for service in ("", GENERATION_SERVICE):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_second_server_on_the_same_port_is_refused(served: Served):
    # Not split with the running one (grpc's default SO_REUSEPORT would allow it).
    config = ServerConfig(port=served.server.server.port)
    with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{config.port}"):
        served.server._run(start_server(served.handle.scheduler, served.handle.model_info, config))
    health = health_pb2_grpc.HealthStub(served.channel)
    response = health.Check(health_pb2.HealthCheckRequest(service=GENERATION_SERVICE), timeout=RPC_TIMEOUT_S)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(served: Served):
    database = ProtoReflectionDescriptorDatabase(served.channel)
    services = set(database.get_services())
    assert {GENERATION_SERVICE, "grpc.health.v1.Health"} <= services
    descriptor = database.FindFileContainingSymbol(GENERATION_SERVICE)
    assert descriptor.package == "kvserve.v1"


def test_get_stats_reports_every_replica_idle(served: Served):
    stats = get_stats(served)
    assert [s.replica for s in stats] == list(range(NUM_REPLICAS))
    for s in stats:
        assert s.healthy
        assert s.num_kv_blocks == NUM_BLOCKS
        assert (s.num_running, s.num_waiting, s.kv_cache_usage) == (0, 0, 0.0)


def _parity_workload() -> list[tuple[str | list[int], SamplingParams]]:
    """32 requests: greedy and seeded sampling, text and token ids, shared prefixes, EOS allowed,
    penalties (the repetition penalty's on the prompt too), logit biases and min_tokens (counted and held back
    on the workers), min-p, prompt logprobs."""
    topics = ["the cat", "a river", "numbers 12345", "héllo wörld 日本語", "once upon a time"]
    workload: list[tuple[str | list[int], SamplingParams]] = []
    for i in range(NUM_STREAMS):
        prompt: str | list[int] = f"{topics[i % len(topics)]} and story number {i} " * (1 + i % 3)
        if i % 8 == 7:
            prompt = [(17 * i + 31 * j) % 1000 for j in range(5 + i)]
        if i % 8 == 5:
            params = SamplingParams(max_tokens=8 + i % 17, temperature=0.8, seed=1000 + i, frequency_penalty=1.0,
                                    logit_bias={42: 3.0}, repetition_penalty=0.8)
        elif i % 4 == 1:
            params = SamplingParams(max_tokens=8 + i % 17, temperature=0.8, top_p=0.9, top_k=50, seed=1000 + i,
                                    min_p=0.1 if i % 16 == 1 else 0.0)
        elif i % 8 == 3:
            # A fifth of the vocabulary stops the request, but not before 4 tokens.
            params = SamplingParams(max_tokens=8 + i % 17, temperature=0.0, logit_bias={42: 10.0, 7: -100.0},
                                    frequency_penalty=2.0, presence_penalty=0.5, min_tokens=4,
                                    stop_token_ids=tuple(range(i % 5, 1000, 5)), repetition_penalty=1.3)
        elif i % 4 == 2:
            # A fifth of the vocabulary stops the request: some stop early.
            params = SamplingParams(max_tokens=8 + i % 17, temperature=0.0, stop_token_ids=tuple(range(i % 5, 1000, 5)))
        else:
            params = SamplingParams(max_tokens=8 + i % 17, temperature=0.0, ignore_eos=i % 3 == 0,
                                    prompt_logprobs=2 if i % 8 == 0 else None)
        workload.append((prompt, params))
    return workload


def _to_proto(params: SamplingParams) -> generate_pb2.SamplingParams:
    proto = generate_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        ignore_eos=params.ignore_eos,
        stop_token_ids=params.stop_token_ids,
    )
    if params.top_k is not None:
        proto.top_k = params.top_k
    if params.seed is not None:
        proto.seed = params.seed
    if params.prompt_logprobs is not None:
        proto.prompt_logprobs = params.prompt_logprobs
    if params.min_p:
        proto.min_p = params.min_p
    if params.adjusts_logits:
        proto.presence_penalty = params.presence_penalty
        proto.frequency_penalty = params.frequency_penalty
        proto.min_tokens = params.min_tokens
        proto.logit_bias.update(dict(params.logit_bias))
        if params.penalizes_prompt:
            proto.repetition_penalty = params.repetition_penalty
    return proto


def record_launches(served: Served) -> None:
    """From now on, each replica's executor notes the placeholder rows of every step it launches."""

    def install(actor) -> None:
        for replica in actor._replicas.values():
            executor, launches = replica.engine.executor, []
            launch = executor.launch

            async def recording(plan, launch=launch, launches=launches):
                launches.append(len(plan.placeholder_rows))
                return await launch(plan)

            executor.launch, executor.launches = recording, launches

    ray.get(served.handle.scheduler.__ray_call__.remote(install), timeout=RPC_TIMEOUT_S)


def launched_placeholder_rows(served: Served) -> list[list[int]]:
    """Per replica, the placeholder rows of each step launched since ``record_launches``."""
    return ray.get(
        served.handle.scheduler.__ray_call__.remote(
            lambda actor: [r.engine.executor.launches for _, r in sorted(actor._replicas.items())]
        ),
        timeout=RPC_TIMEOUT_S,
    )


def test_concurrent_streams_generate_exactly_what_the_in_process_engine_does(served: Served):
    workload = _parity_workload()
    with LLM(
        served.model_dir,
        tensor_parallel_size=TP_SIZE,
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
    ) as llm:
        expected = llm.generate([prompt for prompt, _ in workload], [params for _, params in workload])

    record_launches(served)
    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        streams = list(
            pool.map(
                lambda item: collect(served.stub.Generate(request(item[0], _to_proto(item[1])), timeout=RPC_TIMEOUT_S)),
                workload,
            )
        )
    # Overlapped, the replicas sent steps ahead of their samples (placeholder rows); plain, they never launched.
    placeholders = launched_placeholder_rows(served)
    if served.overlapped:
        assert all(sum(rows) > 0 for rows in placeholders), placeholders
    else:
        assert placeholders == [[], []]

    replicas = []
    for want, messages in zip(expected, streams, strict=True):
        *body, last = messages
        assert [t for m in messages for t in m.token_ids] == want.token_ids
        assert "".join(m.text for m in messages) == want.text
        assert all(m.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED for m in body)
        assert generate_pb2.FinishReason.Name(last.finish_reason) == f"FINISH_REASON_{want.finish_reason.upper()}"
        assert last.usage.prompt_tokens == len(want.prompt_token_ids)
        assert last.usage.completion_tokens == len(want.token_ids)
        assert len({m.request_id for m in messages}) == 1
        # Prompt logprobs come once, on the first message with tokens.
        assert [len(m.prompt_logprobs) for m in messages if m.prompt_logprobs] == (
            [len(want.prompt_token_ids) - 1] if want.prompt_logprobs is not None else []
        )
        if want.prompt_logprobs is not None:
            got = [entry.logprob for entry in messages[0].prompt_logprobs]
            assert got == pytest.approx([entry.logprob for entry in want.prompt_logprobs[1:]], abs=1e-4)
        replicas.append(last.replica)
    # Round robin: each replica served half of the streams.
    assert sorted(replicas) == [0] * (NUM_STREAMS // 2) + [1] * (NUM_STREAMS // 2)
    assert any(want.finish_reason == "stop" for want in expected)
    assert all(len(want.token_ids) >= params.min_tokens for (_, params), want in zip(workload, expected))
    wait_until_pools_are_full(served)


def test_the_clusters_actors_leave_no_record_of_their_calls_in_rays_gcs(served: Served):
    """Ray's GCS keeps an event per actor call unless told not to: 3-4 calls per request served,
    about 11 KB each, up to 100,000 of them (its memory grew linearly in a soak test)."""
    from ray._private.state import state as ray_state

    params = generate_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert sum(len(m.token_ids) for m in collect(served.stub.Generate(request("events", params)))) == 4
    actors = [served.handle.scheduler] + [
        ray.get_actor(worker_actor_name(replica, rank), namespace=RAY_NAMESPACE)
        for replica in range(NUM_REPLICAS) for rank in range(TP_SIZE)
    ]
    ids = {actor._actor_id.binary() for actor in actors}
    time.sleep(1.5)  # workers send their task events to the GCS once a second
    events = ray_state._get_all_task_events()
    assert events  # the driver's own calls are recorded: the query itself works
    assert [e.task_info.name for e in events if e.task_info.actor_id in ids] == []


def test_the_scheduler_actor_serves_without_torch_or_transformers_which_its_workers_load(served: Served):
    """The scheduler actor plans steps and builds its workers' configs; with torch and transformers
    loaded it took 2.3 s longer to start and held 328 MB instead of 120 (one CPU replica, session 48)."""
    params = generate_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    assert sum(len(m.token_ids) for m in collect(served.stub.Generate(request("light", params)))) == 2

    def loaded(actor) -> list[str]:
        return ray.get(actor.__ray_call__.remote(lambda _: sorted({"torch", "transformers"} & set(sys.modules))))

    assert loaded(served.handle.scheduler) == []
    worker = ray.get_actor(worker_actor_name(0, 0), namespace=RAY_NAMESPACE)
    assert loaded(worker) == ["torch", "transformers"]  # the check itself can see them


def test_a_stream_interval_sends_the_tokens_of_several_steps_per_message(served: Served):
    params = generate_pb2.SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    messages = collect(served.stub.Generate(request("batched", params), timeout=RPC_TIMEOUT_S))
    assert sum(len(m.token_ids) for m in messages) == 60
    assert len(messages) < 60
    assert max(len(m.token_ids) for m in messages) > 1


def test_a_repeated_prompt_reports_its_cached_prompt_tokens(served: Served):
    prompt = list(range(100, 100 + 4 * BLOCK_SIZE + 3))
    params = generate_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    # Round robin alternates replicas: the third call lands where the first did.
    usages = [collect(served.stub.Generate(request(prompt, params), timeout=RPC_TIMEOUT_S))[-1].usage for _ in range(3)]
    assert usages[0].cached_prompt_tokens == 0
    assert usages[2].cached_prompt_tokens == 4 * BLOCK_SIZE
    assert all(u.prompt_tokens == len(prompt) for u in usages)


# -- bad input -------------------------------------------------------------------

BAD_REQUESTS = {
    "empty text": (request(""), "text"),
    "empty token ids": (request([]), "token_ids"),
    "no prompt": (generate_pb2.GenerateRequest(), "prompt"),
    "token id past the vocabulary": (request([5, 1000]), "token_ids"),
    "negative token id": (request([5, -1]), "token_ids"),
    "max_tokens zero": (request("hi", generate_pb2.SamplingParams(max_tokens=0)), "max_tokens"),
    "prompt + max_tokens past max_model_len": (
        request("hi", generate_pb2.SamplingParams(max_tokens=2048)),
        "max_tokens",
    ),
    "prompt past max_model_len": (request([5] * 2049), "token_ids"),
    "negative temperature": (request("hi", generate_pb2.SamplingParams(temperature=-0.5)), "temperature"),
    "infinite temperature": (request("hi", generate_pb2.SamplingParams(temperature=float("inf"))), "temperature"),
    "nan temperature": (request("hi", generate_pb2.SamplingParams(temperature=float("nan"))), "temperature"),
    "top_p zero": (request("hi", generate_pb2.SamplingParams(top_p=0.0)), "top_p"),
    "top_p above one": (request("hi", generate_pb2.SamplingParams(top_p=1.5)), "top_p"),
    "top_k below -1": (request("hi", generate_pb2.SamplingParams(top_k=-2)), "top_k"),
    "repetition_penalty zero": (
        request("hi", generate_pb2.SamplingParams(repetition_penalty=0.0)),
        "sampling_params.repetition_penalty must be finite and > 0, got 0.0",
    ),
    "min_p above one": (
        request("hi", generate_pb2.SamplingParams(min_p=1.5)),
        "sampling_params.min_p must be in [0, 1], got 1.5",
    ),
    "stop token past the vocabulary": (
        request("hi", generate_pb2.SamplingParams(stop_token_ids=[1000])),
        "stop_token_ids",
    ),
    "request id too long": (request("hi", request_id="x" * 257), "request_id"),
    # Within max_model_len, but more KV blocks than a replica has (checked by the scheduler actor).
    "prompt + max_tokens past the KV pool": (
        request("hi", generate_pb2.SamplingParams(max_tokens=NUM_BLOCKS * BLOCK_SIZE)),
        "sampling_params.max_tokens: request needs up to",
    ),
    # The prompt alone: blaming max_tokens sent the user to lower the wrong number.
    "prompt past the KV pool": (
        request([5] * (NUM_BLOCKS * BLOCK_SIZE), generate_pb2.SamplingParams(max_tokens=1)),
        f"prompt: a prompt of {NUM_BLOCKS * BLOCK_SIZE} tokens alone needs {NUM_BLOCKS} KV blocks",
    ),
}


@pytest.mark.parametrize("bad_request, field", list(BAD_REQUESTS.values()), ids=list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_naming_the_field(served: Served, bad_request, field):
    error = rpc_error(served.stub.Generate(bad_request, timeout=RPC_TIMEOUT_S))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.details()


def test_a_duplicate_request_id_in_flight_is_already_exists(served: Served):
    first = served.stub.Generate(request("first", LONG, request_id="dup"), timeout=RPC_TIMEOUT_S)
    assert next(first).request_id == "dup"
    error = rpc_error(served.stub.Generate(request("second", request_id="dup"), timeout=RPC_TIMEOUT_S))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "request_id" in error.details()
    first.cancel()
    wait_until_pools_are_full(served)


def test_a_message_over_the_size_limit_is_resource_exhausted(served: Served):
    huge = request("x" * (ServerConfig().max_message_bytes + 1))
    error = rpc_error(served.stub.Generate(huge, timeout=RPC_TIMEOUT_S))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    "method, body",
    [
        ("Generate", b"\x0a\x03\xff\xfe\xfd"),  # text: 3 bytes of bad UTF-8
        ("Generate", b"\xff\xff\xff\xff"),  # not protobuf's wire format
        ("GetStats", b"\xff\xff\xff\xff"),
    ],
)
def test_a_body_that_is_not_a_valid_message_is_invalid_argument_without_a_logged_traceback(
    served: Served, caplog: pytest.LogCaptureFixture, method: str, body: bytes
):
    # grpc answered UNKNOWN ("Unexpected <class DecodeError>") and logged a
    # traceback at ERROR for each: any client could flood the server's log.
    path = f"/kvserve.v1.Generation/{method}"
    response_type = generate_pb2.GenerateResponse if method == "Generate" else generate_pb2.GetStatsResponse
    make_call = served.channel.unary_stream if method == "Generate" else served.channel.unary_unary
    call = make_call(path, request_serializer=None, response_deserializer=response_type.FromString)

    with caplog.at_level(logging.ERROR):
        with pytest.raises(grpc.RpcError) as info:
            result = call(body, timeout=RPC_TIMEOUT_S)
            if method == "Generate":
                list(result)

    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    request_type = "GenerateRequest" if method == "Generate" else "GetStatsRequest"
    assert info.value.details().startswith(f"the request is not a valid kvserve.v1.{request_type}: ")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_cluster_keeps_serving_after_bad_input(served: Served):
    params = generate_pb2.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    messages = collect(served.stub.Generate(request("still here", params), timeout=RPC_TIMEOUT_S))
    assert sum(len(m.token_ids) for m in messages) == 5
    assert messages[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH


# -- overload, cancellation, deadlines -------------------------------------------------


def test_more_streams_than_the_limit_are_resource_exhausted(served: Served):
    calls = [
        served.stub.Generate(request(f"hold {i}", LONG), timeout=RPC_TIMEOUT_S) for i in range(MAX_CONCURRENT_REQUESTS)
    ]
    try:
        for call in calls:
            next(call)
        error = rpc_error(served.stub.Generate(request("one too many"), timeout=RPC_TIMEOUT_S))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        for call in calls:
            call.cancel()
    wait_until_pools_are_full(served)


def test_a_cancelled_stream_aborts_its_request_and_frees_its_blocks(served: Served):
    call = served.stub.Generate(request("cancel me", LONG), timeout=RPC_TIMEOUT_S)
    first = next(call)
    stats = get_stats(served)
    assert stats[first.replica].num_running == 1
    assert stats[first.replica].kv_cache_usage > 0
    call.cancel()
    assert rpc_error(call).code() == grpc.StatusCode.CANCELLED
    wait_until_pools_are_full(served)


def test_an_expired_deadline_aborts_its_request_and_frees_its_blocks(served: Served):
    call = served.stub.Generate(request("too slow", LONG), timeout=1.0)
    error = rpc_error(call)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until_pools_are_full(served)


def _add_request_behind_the_front_ends_back(served: Served, req_id: str) -> None:
    params = SamplingParams(max_tokens=LONG.max_tokens, temperature=0.0, ignore_eos=True)
    ray.get(served.handle.scheduler.add_request.remote(RequestSpec(req_id, [5, 6, 7, 8], params)))
    assert sum(s.num_running + s.num_waiting for s in get_stats(served)) == 1


def test_outputs_of_a_request_without_a_stream_are_aborted(served: Served):
    _add_request_behind_the_front_ends_back(served, "no-stream")
    wait_until_pools_are_full(served)


def test_requests_are_aborted_when_no_front_end_fetches_their_outputs(served: Served):
    served.server.pause_front_end()
    try:
        _add_request_behind_the_front_ends_back(served, "nobody-polls")
        wait_until_pools_are_full(served, timeout_s=UNDELIVERED_OUTPUT_TIMEOUT_S + 3.0)
    finally:
        served.server.resume_front_end()


def test_a_front_end_started_after_another_stopped_streams_every_token(served: Served):
    # NOTE: a stopped front end's last poll_outputs call went on waiting in the actor and took the
    # next outputs, the first tokens of the next front end's requests (bench/faults.py, scenario d).
    params = generate_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for _ in range(2):  # the second stop comes just after its dispatcher's poll went out
        served.server.pause_front_end()
        served.server.resume_front_end()
        time.sleep(0.05)
    calls = [served.stub.Generate(request([5, 6, 7, i], params), timeout=RPC_TIMEOUT_S) for i in range(4)]
    num_tokens = [sum(len(m.token_ids) for m in collect(call)) for call in calls]
    assert num_tokens == [8] * 4


# -- failures and shutdown (last: they leave the cluster broken) ------------------------


def test_killing_a_worker_moves_its_streams_without_a_gap_and_the_replica_comes_back(served: Served):
    params = generate_pb2.SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    prompts = [f"in flight {i}" for i in range(4)]
    calls = [served.stub.Generate(request(prompt, params), timeout=RPC_TIMEOUT_S) for prompt in prompts]
    firsts = [next(call) for call in calls]
    assert sorted(first.replica for first in firsts) == [0, 0, 1, 1]

    ray.kill(ray.get_actor(worker_actor_name(1, 0), namespace=RAY_NAMESPACE))
    killed_at = time.monotonic()

    # Every stream ends normally, replica 1's continued on replica 0.
    streams = [[first, *collect(call)] for first, call in zip(firsts, calls)]
    for stream in streams:
        assert stream[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert stream[-1].usage.completion_tokens == 120
    moved = [stream for stream in streams if stream[0].replica == 1]
    assert len(moved) == 2 and all(stream[-1].replica == 0 for stream in moved)
    faulted_tokens = [[t for message in stream for t in message.token_ids] for stream in streams]

    # The replica is started again and rejoins with an empty cache.
    while not all(s.healthy for s in get_stats(served)):
        assert time.monotonic() - killed_at < 60, f"replica 1 not back 60 s after the kill: {get_stats(served)}"
        time.sleep(0.2)
    stats = wait_until_pools_are_full(served)
    assert stats[1].kv_cache_usage == 0
    # GetStats tells the outage after it ended (healthy could not), and no step is left hanging.
    assert [s.num_failures for s in stats] == [0, 1]
    assert [s.step_age_seconds for s in stats] == [0.0, 0.0]

    # Without the fault, the same prompts give the same tokens: nothing lost, nothing repeated.
    again = [collect(served.stub.Generate(request(prompt, params), timeout=RPC_TIMEOUT_S)) for prompt in prompts]
    assert [[t for message in stream for t in message.token_ids] for stream in again] == faulted_tokens
    assert {stream[-1].replica for stream in again} == {0, 1}  # replica 1 serves again


def test_shutdown_removes_every_actor_and_placement_group(served: Served):
    served.handle.shutdown()
    names = [SCHEDULER_ACTOR_NAME] + [
        worker_actor_name(replica, rank) for replica in range(NUM_REPLICAS) for rank in range(TP_SIZE)
    ]
    deadline = time.monotonic() + 10
    while (alive := [name for name in names if _actor_exists(name)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive == []
    assert len(served.handle.placement_groups) == NUM_REPLICAS
    for group in served.handle.placement_groups:
        assert ray.util.placement_group_table(group)["state"] == "REMOVED"


def _actor_exists(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=RAY_NAMESPACE)
    except ValueError:
        return False
    return True
