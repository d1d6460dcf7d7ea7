"""The scheduler side of the step protocol: one replica's ranks behind ``AsyncExecutor``.

Every step goes to every rank of the replica at once (the ranks meet in
their collectives), encoded and serialized once.  Rank 0 answers with the
samples, the other ranks with an empty result.  The first rank that fails,
or does not answer within the step deadline, fails the whole replica: the
pending calls are cancelled (the other ranks may be stuck in a collective
waiting for the dead one) and every later call raises at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from typing import NoReturn

import grpc

from kvserve.cluster.step_codec import decode_result, encode_plan
from kvserve.cluster.step_servicer import GRPC_OPTIONS
from kvserve.proto import step_pb2, step_pb2_grpc
from kvserve.scheduler.executor import ReplicaFailedError
from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult

logger = logging.getLogger(__name__)

DEFAULT_STEP_TIMEOUT_S = 120.0
_CONTROL_TIMEOUT_S = 60.0
_SHUTDOWN_TIMEOUT_S = 5.0
_SERVICE = step_pb2.DESCRIPTOR.services_by_name["StepWorker"]
_EXECUTE_STEP_PATH = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['ExecuteStep'].name}"


class GrpcReplicaExecutor:
    """An ``AsyncExecutor`` that sends each plan to the StepWorker servers of every rank.

    ``addresses[r]`` is rank ``r``'s ``host:port``.  Create it, and use it,
    on one running event loop (``grpc.aio`` channels belong to their loop).
    ``initialize_cache()`` must run once before the first ``execute``.
    """

    def __init__(
        self,
        replica_id: int,
        addresses: Sequence[str],
        *,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
    ) -> None:
        if not addresses:
            raise ValueError("addresses must name at least one rank")
        if step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be > 0, got {step_timeout_s}")
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("create a GrpcReplicaExecutor on the event loop that will use it") from None
        self.replica_id = replica_id
        self.addresses = list(addresses)
        self.step_timeout_s = step_timeout_s
        self._channels = [grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) for address in self.addresses]
        self._stubs = [step_pb2_grpc.StepWorkerStub(channel) for channel in self._channels]
        # NOTE: the plan is serialized once and the same bytes go to every rank,
        # so ExecuteStep is called without a request serializer.
        self._execute_calls = [
            channel.unary_unary(_EXECUTE_STEP_PATH, response_deserializer=step_pb2.StepResult.FromString)
            for channel in self._channels
        ]
        self._num_kv_blocks: int | None = None
        self._failure: str | None = None
        self._closed = False

    @property
    def num_kv_blocks(self) -> int:
        if self._num_kv_blocks is None:
            raise RuntimeError(f"replica {self.replica_id}: initialize_cache() has not run")
        return self._num_kv_blocks

    @property
    def tp_size(self) -> int:
        return len(self.addresses)

    @property
    def failed(self) -> bool:
        return self._failure is not None

    async def initialize_cache(self) -> int:
        """Allocate the same number of KV blocks on every rank (the minimum they can hold)."""
        replies = await self._call_all(
            "DetermineNumBlocks",
            [stub.DetermineNumBlocks(step_pb2.Empty(), timeout=_CONTROL_TIMEOUT_S) for stub in self._stubs],
        )
        num_blocks = min(reply.num_blocks for reply in replies)
        request = step_pb2.NumBlocks(num_blocks=num_blocks)
        await self._call_all(
            "InitializeCache",
            [stub.InitializeCache(request, timeout=_CONTROL_TIMEOUT_S) for stub in self._stubs],
        )
        self._num_kv_blocks = num_blocks
        logger.info("replica %d: %d KV blocks on each of %d ranks", self.replica_id, num_blocks, self.tp_size)
        return num_blocks

    async def execute(self, plan: StepPlan) -> StepResult:
        """Run ``plan`` on every rank; rank 0's samples. ``ReplicaFailedError`` if any rank fails."""
        self._check_usable()
        data = encode_plan(plan).SerializeToString()
        timeout = self.step_timeout_s
        replies = await self._call_all(
            f"step {plan.step_id}", [call(data, timeout=timeout) for call in self._execute_calls]
        )
        try:
            result = decode_result(replies[0])
        except ValueError as exc:
            self._fail(f"replica {self.replica_id} rank 0 answered step {plan.step_id} with a malformed result: {exc}")
        if result is None or result.step_id != plan.step_id:
            self._fail(f"replica {self.replica_id} rank 0 did not answer step {plan.step_id} with its samples")
        return result

    async def shutdown(self) -> None:
        """Ask every rank to release its worker (best effort), then close the channels."""
        if self._closed:
            return
        self._closed = True
        # A failed replica may have ranks stuck in a collective: they would not answer.
        if self._failure is None:
            calls = [stub.Shutdown(step_pb2.Empty(), timeout=_SHUTDOWN_TIMEOUT_S) for stub in self._stubs]
            for rank, outcome in enumerate(await asyncio.gather(*calls, return_exceptions=True)):
                if isinstance(outcome, BaseException):
                    logger.warning("replica %d rank %d did not shut down cleanly: %s", self.replica_id, rank, outcome)
        await asyncio.gather(*(channel.close() for channel in self._channels), return_exceptions=True)

    # -- internals ---------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise ReplicaFailedError(self._failure)
        if self._closed:
            raise ReplicaFailedError(f"replica {self.replica_id} is shut down")

    def _fail(self, message: str) -> NoReturn:
        if self._failure is None:
            self._failure = message
            logger.error("%s", message)
        raise ReplicaFailedError(message)

    async def _call_all(self, what: str, calls: Sequence[Awaitable]) -> list:
        """Await one call per rank; the first failure cancels the rest and fails the replica."""
        tasks = [asyncio.ensure_future(call) for call in calls]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            # The workers may be ahead of the scheduler now: the replica cannot go on.
            for task in tasks:
                task.cancel()
            self._failure = self._failure or f"replica {self.replica_id}: {what} was cancelled in flight"
            raise
        failures = [
            (rank, task.exception())
            for rank, task in enumerate(tasks)
            if task.done() and task.exception() is not None
        ]
        if failures:
            for task in tasks:
                task.cancel()
            rank, exc = failures[0]
            self._fail(f"replica {self.replica_id} rank {rank} failed at {what}: {_describe(exc)}")
        return [task.result() for task in tasks]


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
