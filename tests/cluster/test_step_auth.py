"""A rank's StepWorker server takes calls only from its replica's scheduler, which holds the secret.

Real gRPC on 127.0.0.1, the server in this process: a caller without the secret,
or with another, is refused ``UNAUTHENTICATED`` before its request is read, and
the rank keeps serving.  The front end's interceptor refuses the same way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import grpc
import pytest

from kvserve.cluster.auth import TokenTable
from kvserve.cluster.grpc_auth import BearerTokenInterceptor, bearer_metadata
from kvserve.cluster.replica_client import GrpcReplicaExecutor
from kvserve.cluster.step_codec import encode_plan
from kvserve.cluster.step_servicer import start_step_server
from kvserve.proto import step_pb2
from kvserve.scheduler.executor import ReplicaFailedError
from tests.cluster.test_step_stream import NUM_BLOCKS, Rank, plan

SECRET = "the-replica-secret-of-these-tests"
AUTH = bearer_metadata(SECRET)
_SERVICE = "/kvserve.internal.v1.StepWorker/"
METHODS = ["DetermineNumBlocks", "InitializeCache", "ExecuteSteps", "Shutdown"]
# Not a protobuf message: field 15, wire type 7 does not exist.
GARBAGE = b"\x7f" * 64
WRONG_CREDENTIALS = {
    "no metadata": None,
    "another secret": bearer_metadata("not-the-secret-of-this-replica"),
    "the secret without Bearer": (("authorization", SECRET),),
    "the secret under another key": (("x-secret", SECRET),),
}


@asynccontextmanager
async def rank_server(rank: Rank, secret: str = SECRET) -> AsyncIterator[str]:
    """``rank`` served on 127.0.0.1 with ``secret``; yields its address."""
    thread = ThreadPoolExecutor(max_workers=1)
    server, address = await start_step_server(rank, thread, "127.0.0.1", secret=secret)
    try:
        yield address
    finally:
        await server.stop(None)
        thread.shutdown(wait=False, cancel_futures=True)


async def call_code(channel: grpc.aio.Channel, method: str, metadata, body: bytes = b"") -> grpc.StatusCode:
    """The status of one call of ``method`` sending ``body`` (raw bytes) as its one request.

    A unary call whatever the method's kind (the same bytes on the wire): its request and
    end of stream go out at once, so no write races the server's refusal.
    """
    try:
        await channel.unary_unary(_SERVICE + method)(body, metadata=metadata, timeout=5)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()


@pytest.mark.parametrize("credentials", WRONG_CREDENTIALS.values(), ids=WRONG_CREDENTIALS.keys())
def test_every_method_refuses_a_call_without_the_secret_and_never_reaches_the_rank(credentials) -> None:
    rank = Rank(sample=True)

    async def scenario() -> dict[str, grpc.StatusCode]:
        async with rank_server(rank) as address, grpc.aio.insecure_channel(address) as channel:
            body = {"InitializeCache": step_pb2.NumBlocks(num_blocks=8).SerializeToString(),
                    "ExecuteSteps": encode_plan(plan(0)).SerializeToString()}
            return {method: await call_code(channel, method, credentials, body.get(method, b"")) for method in METHODS}

    assert asyncio.run(scenario()) == dict.fromkeys(METHODS, grpc.StatusCode.UNAUTHENTICATED)
    assert rank.threads == set() and rank.plans == [] and not rank.shut_down


def test_a_refused_shutdown_leaves_the_rank_serving_its_scheduler() -> None:
    rank = Rank(sample=True)

    async def scenario() -> list[int]:
        async with rank_server(rank) as address:
            executor = GrpcReplicaExecutor(0, [address], secret=SECRET)
            await executor.initialize_cache()
            # NOTE: before the first step: a rank serves one call at a time, so a call made
            # while the scheduler's step stream is open waits for it to end (refused even so).
            async with grpc.aio.insecure_channel(address) as intruder:
                for credentials in WRONG_CREDENTIALS.values():
                    assert await call_code(intruder, "Shutdown", credentials) == grpc.StatusCode.UNAUTHENTICATED
            assert not rank.shut_down
            results = [await executor.execute(plan(i)) for i in range(3)]
            await executor.shutdown()
            return [result.step_id for result in results]

    assert asyncio.run(scenario()) == [0, 1, 2]
    assert rank.shut_down


def test_the_scheduler_with_another_replicas_secret_fails_the_replica_unauthenticated() -> None:
    async def scenario() -> None:
        async with rank_server(Rank(sample=True)) as address:
            executor = GrpcReplicaExecutor(0, [address], secret="the-secret-of-another-replica")
            with pytest.raises(ReplicaFailedError, match="rank 0 failed at DetermineNumBlocks: UNAUTHENTICATED"):
                await executor.initialize_cache()
            await executor.shutdown()

    asyncio.run(scenario())


def test_a_refused_calls_body_is_never_parsed_however_malformed_or_large() -> None:
    async def scenario() -> dict[str, grpc.StatusCode]:
        async with rank_server(Rank(sample=True)) as address, grpc.aio.insecure_channel(address) as channel:
            return {
                "garbage": await call_code(channel, "InitializeCache", None, GARBAGE),
                "garbage step": await call_code(channel, "ExecuteSteps", None, GARBAGE),
                "8 MiB": await call_code(channel, "InitializeCache", None, GARBAGE * (2**17)),
                # The same garbage with the secret is parsed, and fails: the refusal above never parsed it.
                "garbage with the secret": await call_code(channel, "InitializeCache", AUTH, GARBAGE),
            }

    assert asyncio.run(scenario()) == {
        "garbage": grpc.StatusCode.UNAUTHENTICATED,
        "garbage step": grpc.StatusCode.UNAUTHENTICATED,
        "8 MiB": grpc.StatusCode.UNAUTHENTICATED,
        "garbage with the secret": grpc.StatusCode.INTERNAL,
    }


def test_a_refused_unary_call_is_answered_without_waiting_for_its_request() -> None:
    # A caller that never sends its request must not hold the rank's one worker thread.
    async def scenario() -> tuple[grpc.StatusCode, float]:
        async with rank_server(Rank(sample=True)) as address, grpc.aio.insecure_channel(address) as channel:
            start = time.monotonic()
            call = channel.stream_stream(_SERVICE + "Shutdown")(timeout=5)  # headers only, no request
            code = await call.code()
            return code, time.monotonic() - start

    code, elapsed_s = asyncio.run(scenario())
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert elapsed_s < 2.0


def test_a_server_with_an_empty_secret_is_refused() -> None:
    async def scenario() -> None:
        with pytest.raises(ValueError, match="must not be empty"):
            await start_step_server(Rank(sample=True), ThreadPoolExecutor(max_workers=1), "127.0.0.1", secret="")

    asyncio.run(scenario())


def test_a_worker_actor_serves_only_callers_with_the_secret_it_was_started_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray.util

    from kvserve.cluster.worker_actor import WorkerActor
    from kvserve.scheduler.cost_model import StepCostModel
    from kvserve.scheduler.simulation.simulated_worker import SimulatedWorkerConfig, SimulationConfig

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    config = SimulatedWorkerConfig(
        SimulationConfig(StepCostModel(a=0.001, b=0.0, c=0.0, d=0.0), vocab_size=500), num_blocks=16
    )
    actor = WorkerActor(replica_id=0, rank=0)

    async def scenario() -> tuple[grpc.StatusCode, int]:
        for secret in ("", None):
            with pytest.raises(ValueError, match="needs its replica's secret"):
                await actor.start(config, secret=secret)
        assert actor._worker is None  # noqa: SLF001 - nothing was built
        address = await actor.start(config, secret=SECRET)
        try:
            async with grpc.aio.insecure_channel(address) as intruder:
                refused = await call_code(intruder, "DetermineNumBlocks", None)
            executor = GrpcReplicaExecutor(0, [address], secret=SECRET)
            num_blocks = await executor.initialize_cache()
            await executor.shutdown()
        finally:
            await actor._server.stop(None)  # noqa: SLF001
        return refused, num_blocks

    try:
        assert asyncio.run(scenario()) == (grpc.StatusCode.UNAUTHENTICATED, 16)
    finally:
        actor._thread.shutdown()  # noqa: SLF001


# -- the front end's interceptor refuses the same way --------------------------------------


async def _echo(request: step_pb2.NumBlocks, context: grpc.aio.ServicerContext) -> step_pb2.NumBlocks:
    return request


@asynccontextmanager
async def front_end_server() -> AsyncIterator[grpc.aio.Channel]:
    """A ``grpc.aio`` server with the front end's interceptor and one unary method, ``/test.Echo/Echo``."""
    server = grpc.aio.server(interceptors=[BearerTokenInterceptor(TokenTable({SECRET: "tenant"}))])
    echo = grpc.unary_unary_rpc_method_handler(
        _echo, request_deserializer=step_pb2.NumBlocks.FromString,
        response_serializer=step_pb2.NumBlocks.SerializeToString,
    )
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", {"Echo": echo})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(None)


def test_the_front_ends_interceptor_never_parses_a_refused_body() -> None:
    async def code(channel: grpc.aio.Channel, metadata, body: bytes) -> grpc.StatusCode:
        try:
            await channel.unary_unary("/test.Echo/Echo")(body, metadata=metadata, timeout=5)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            return exc.code()

    async def scenario() -> dict[str, grpc.StatusCode]:
        async with front_end_server() as channel:
            no_body = channel.stream_stream("/test.Echo/Echo")(timeout=5)  # headers only
            return {
                "garbage": await code(channel, None, GARBAGE),
                "8 MiB, over the 4 MiB limit": await code(channel, None, GARBAGE * (2**17)),
                "no body sent": await no_body.code(),
                "garbage with the token": await code(channel, AUTH, GARBAGE),
                "a message with the token": await code(
                    channel, AUTH, step_pb2.NumBlocks(num_blocks=3).SerializeToString()
                ),
            }

    assert asyncio.run(scenario()) == {
        "garbage": grpc.StatusCode.UNAUTHENTICATED,
        "8 MiB, over the 4 MiB limit": grpc.StatusCode.UNAUTHENTICATED,
        "no body sent": grpc.StatusCode.UNAUTHENTICATED,
        "garbage with the token": grpc.StatusCode.UNKNOWN,  # parsed, and failed: the refusal never parsed it
        "a message with the token": grpc.StatusCode.OK,
    }
