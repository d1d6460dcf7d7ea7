"""The worker side of the step protocol: a StepWorker gRPC server around one rank.

The server is grpc's threaded server, not ``grpc.aio``, and its only thread
is the rank's worker thread: every RPC runs there, so a step reaches the
worker without a hand-off between threads (which would cost about as much
as the rest of the protocol), and every call into the worker comes from the
same thread (torch.distributed collectives require it; so does the device
context of a GPU)::

    scheduler ──ExecuteSteps stream──▶ worker thread: parse, decode_plan,
                                                      runner.execute (the forward pass),
    scheduler ◀──── StepResult ─────── worker thread: encode_result

NOTE: RPCs are therefore served one at a time.  The scheduler of the rank's
replica keeps one ``ExecuteSteps`` stream open and ends it before it calls
``Shutdown``; any other call waits until that stream ends.

A malformed plan ends its stream with ``INVALID_ARGUMENT``, a failing step
with ``INTERNAL``; neither takes the server down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

import grpc

from kvserve.cluster.step_codec import decode_plan, encode_result
from kvserve.proto import step_pb2, step_pb2_grpc
from kvserve.scheduler.checks import check_num_blocks
from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult

logger = logging.getLogger(__name__)

T = TypeVar("T")

# NOTE: explicit, never unlimited: a plan of 256 new requests with 64 blocks
# each is ~100 KiB, so 64 MiB leaves room for very long prefills.
MAX_MESSAGE_BYTES = 64 * 2**20
GRPC_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


class StepRunner(Protocol):
    """What the servicer drives: a ``kvserve.worker.worker.Worker`` (or a stand-in in benchmarks)."""

    def determine_num_blocks(self) -> int: ...

    def initialize_cache(self, num_blocks: int) -> None: ...

    def execute(self, plan: StepPlan) -> StepResult | None: ...

    def shutdown(self) -> None: ...


class StepWorkerServicer(step_pb2_grpc.StepWorkerServicer):
    """Serves one rank's ``StepRunner``; its methods run on the rank's worker thread."""

    def __init__(self, runner: StepRunner) -> None:
        self._runner = runner

    def _run(self, context: grpc.ServicerContext, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``; a failure is answered ``INTERNAL``."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, the server keeps serving
            logger.exception("%s failed", getattr(fn, "__name__", fn))
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    def DetermineNumBlocks(self, request: step_pb2.Empty, context: grpc.ServicerContext) -> step_pb2.NumBlocks:
        return step_pb2.NumBlocks(num_blocks=self._run(context, self._runner.determine_num_blocks))

    def InitializeCache(self, request: step_pb2.NumBlocks, context: grpc.ServicerContext) -> step_pb2.Empty:
        try:
            check_num_blocks(request.num_blocks)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._run(context, self._runner.initialize_cache, request.num_blocks)
        return step_pb2.Empty()

    def ExecuteSteps(
        self, request_iterator: Iterable[step_pb2.StepPlan], context: grpc.ServicerContext
    ) -> Iterator[step_pb2.StepResult]:
        execute = self._runner.execute
        for request in request_iterator:
            try:
                plan = decode_plan(request)
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {request.step_id}: {exc}")
            yield encode_result(plan.step_id, self._run(context, execute, plan))

    def Shutdown(self, request: step_pb2.Empty, context: grpc.ServicerContext) -> step_pb2.Empty:
        self._run(context, self._runner.shutdown)
        return step_pb2.Empty()


class StepServer:
    """A started StepWorker server; ``stop`` it from the event loop that started it."""

    def __init__(self, server: grpc.Server) -> None:
        self._server = server

    async def stop(self, grace: float | None = None) -> None:
        """Cancel the calls in flight after ``grace`` seconds (at once for ``None``) and close."""
        await asyncio.to_thread(self._server.stop(grace).wait)


async def start_step_server(runner: StepRunner, thread: ThreadPoolExecutor, host: str) -> tuple[StepServer, str]:
    """Start a StepWorker server for ``runner`` on ``host`` and a free port; returns it and ``host:port``.

    ``thread`` is the rank's worker thread, a ``ThreadPoolExecutor`` of one
    thread: the server runs every RPC on it, so every call into ``runner``
    runs there.
    """
    server = grpc.server(thread, options=GRPC_OPTIONS)
    step_pb2_grpc.add_StepWorkerServicer_to_server(StepWorkerServicer(runner), server)
    port = server.add_insecure_port(join_host_port(host, 0))
    if port == 0:
        raise RuntimeError(f"could not bind a StepWorker server on {host}")
    server.start()
    return StepServer(server), join_host_port(host, port)


def join_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
