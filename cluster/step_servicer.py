"""The worker side of the step protocol: a ``grpc.aio`` StepWorker server around one rank.

The servicer decodes each message, hands the work to the rank's single
worker thread (torch.distributed collectives must always run on the same
thread, and a forward pass must not block the event loop), and encodes the
answer.  A malformed plan is answered ``INVALID_ARGUMENT``; a failing step
``INTERNAL``; neither takes the server down.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from typing import Protocol, TypeVar

import grpc

from kvserve.cluster.step_codec import decode_plan, encode_result
from kvserve.proto import step_pb2, step_pb2_grpc
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
    """Serves one rank's ``StepRunner``; every call runs on ``thread`` (one worker thread)."""

    def __init__(self, runner: StepRunner, thread: ThreadPoolExecutor) -> None:
        self._runner = runner
        self._thread = thread

    async def _run(self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the worker thread; a failure is answered ``INTERNAL``."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, the server keeps serving
            logger.exception("%s failed", getattr(fn, "__name__", fn))
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    async def DetermineNumBlocks(self, request: step_pb2.Empty, context: grpc.aio.ServicerContext) -> step_pb2.NumBlocks:
        return step_pb2.NumBlocks(num_blocks=await self._run(context, self._runner.determine_num_blocks))

    async def InitializeCache(self, request: step_pb2.NumBlocks, context: grpc.aio.ServicerContext) -> step_pb2.Empty:
        if request.num_blocks < 2:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"num_blocks must be >= 2, got {request.num_blocks}")
        await self._run(context, self._runner.initialize_cache, request.num_blocks)
        return step_pb2.Empty()

    async def ExecuteStep(self, request: step_pb2.StepPlan, context: grpc.aio.ServicerContext) -> step_pb2.StepResult:
        try:
            plan = decode_plan(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {request.step_id}: {exc}")
        result = await self._run(context, self._runner.execute, plan)
        return encode_result(plan.step_id, result)

    async def Shutdown(self, request: step_pb2.Empty, context: grpc.aio.ServicerContext) -> step_pb2.Empty:
        await self._run(context, self._runner.shutdown)
        return step_pb2.Empty()


async def start_step_server(runner: StepRunner, thread: ThreadPoolExecutor, host: str) -> tuple[grpc.aio.Server, str]:
    """Start a StepWorker server for ``runner`` on ``host`` and a free port; returns it and ``host:port``."""
    server = grpc.aio.server(options=GRPC_OPTIONS)
    step_pb2_grpc.add_StepWorkerServicer_to_server(StepWorkerServicer(runner, thread), server)
    port = server.add_insecure_port(join_host_port(host, 0))
    if port == 0:
        raise RuntimeError(f"could not bind a StepWorker server on {host}")
    await server.start()
    return server, join_host_port(host, port)


def join_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
