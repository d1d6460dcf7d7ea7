"""The scheduler side of the step protocol: one replica's ranks behind ``AsyncExecutor``.

Every step goes to every rank of the replica at once (the ranks meet in
their collectives), encoded and serialized once, as the next message of one
long-lived ``ExecuteSteps`` stream per rank (opened by the first step): a
message on an open stream costs a fraction of a unary call, whose set-up
would otherwise be a good part of a short decode step.  Rank 0 answers with
the samples, the other ranks with an empty result.  The first rank that
fails, or does not answer within the step deadline, fails the whole replica:
the streams are cancelled (the other ranks may be stuck in a collective
waiting for the dead one) and every later call raises at once.  The step
deadline (``step_timeout_s``, ``ClusterConfig.step_timeout_s``) is all that
finds a rank that hangs (stopped, or stuck in a kernel) without dying.

With overlapped scheduling (``launch``), the next plans are sent while the ranks
still run the previous one (``STEPS_AHEAD``): the ranks read them from their
stream as soon as they answered, so the round trip to the scheduler, its update
and its next plan hide behind the ranks' work.  A step's deadline runs from when
it is the oldest in flight (the one the ranks work on), not from its sending.

Every call carries the replica's secret as its metadata
(``authorization: Bearer <secret>``, see ``kvserve.cluster.step_servicer``):
once per call, so once per step stream, never with each step.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import grpc

from kvserve.cluster.config import DEFAULT_STEP_TIMEOUT_S
from kvserve.cluster.grpc_auth import bearer_metadata
from kvserve.cluster.step_codec import decode_result, encode_plan
from kvserve.cluster.step_servicer import GRPC_OPTIONS
from kvserve.proto import step_pb2, step_pb2_grpc
from kvserve.scheduler.executor import ReplicaFailedError
from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Steps the scheduler keeps in flight between its calls (EngineCore.steps_ahead): two, so that
# the workers hold the next plan when they finish a step; the scheduler's round trip then runs
# beside their step, not between two.  One more is in flight while the next one is being sent.
STEPS_AHEAD = 2
MAX_STEPS_IN_FLIGHT = STEPS_AHEAD + 1
_CONTROL_TIMEOUT_S = 60.0
_SHUTDOWN_TIMEOUT_S = 5.0
_SERVICE = step_pb2.DESCRIPTOR.services_by_name["StepWorker"]
_EXECUTE_STEPS_PATH = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['ExecuteSteps'].name}"


class GrpcReplicaExecutor:
    """An ``AsyncExecutor`` that sends each plan to the StepWorker servers of every rank.

    ``addresses[r]`` is rank ``r``'s ``host:port``; ``secret`` is the one its servers
    were started with.  Create it, and use it,
    on one running event loop (``grpc.aio`` channels belong to their loop).
    ``initialize_cache()`` must run once before the first step; steps are
    answered in the order they were sent (``execute``, or ``launch`` to send one
    before the previous one's answer).
    """

    def __init__(
        self,
        replica_id: int,
        addresses: Sequence[str],
        *,
        secret: str,
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
        self._metadata = bearer_metadata(secret)
        self._channels = [grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) for address in self.addresses]
        self._stubs = [step_pb2_grpc.StepWorkerStub(channel) for channel in self._channels]
        # NOTE: the plan is serialized once and the same bytes go to every rank,
        # so ExecuteSteps is opened without a request serializer.
        self._open_calls = [
            channel.stream_stream(_EXECUTE_STEPS_PATH, response_deserializer=step_pb2.StepResult.FromString)
            for channel in self._channels
        ]
        self._streams: list[grpc.aio.StreamStreamCall] = []
        # Steps sent and not yet answered, oldest first (up to MAX_STEPS_IN_FLIGHT, overlapped).
        self._in_flight: deque[_StepInFlight] = deque()
        self._expired: str | None = None
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
            [
                stub.DetermineNumBlocks(step_pb2.Empty(), timeout=_CONTROL_TIMEOUT_S, metadata=self._metadata)
                for stub in self._stubs
            ],
        )
        num_blocks = min(reply.num_blocks for reply in replies)
        request = step_pb2.NumBlocks(num_blocks=num_blocks)
        await self._call_all(
            "InitializeCache",
            [
                stub.InitializeCache(request, timeout=_CONTROL_TIMEOUT_S, metadata=self._metadata)
                for stub in self._stubs
            ],
        )
        self._num_kv_blocks = num_blocks
        logger.info("replica %d: %d KV blocks on each of %d ranks", self.replica_id, num_blocks, self.tp_size)
        return num_blocks

    async def execute(self, plan: StepPlan) -> StepResult:
        """Run ``plan`` on every rank; rank 0's samples. ``ReplicaFailedError`` if any rank fails."""
        return await self._receive(await self._send(plan))

    @property
    def launches_ahead(self) -> bool:
        """The ranks are other processes (worker actors): the next plan is made while they run this one."""
        return True

    @property
    def steps_ahead(self) -> int:
        """Steps the scheduler should keep in flight (``EngineCore.steps_ahead``): ``STEPS_AHEAD``."""
        return STEPS_AHEAD

    async def launch(self, plan: StepPlan) -> PendingGrpcStep:
        """Send ``plan`` to every rank and return before it ran (overlapped scheduling).

        Its samples come from ``await result()``, in launch order; meanwhile the next
        plan can be sent, and the ranks start it as soon as they answered this one.
        """
        return PendingGrpcStep(self, await self._send(plan))

    async def _send(self, plan: StepPlan) -> _StepInFlight:
        self._check_usable()
        if len(self._in_flight) >= MAX_STEPS_IN_FLIGHT:
            raise RuntimeError(f"replica {self.replica_id}: {len(self._in_flight)} steps are already in flight")
        what = f"step {plan.step_id}"
        data = encode_plan(plan).SerializeToString()
        streams = self._streams or self._open_streams()
        step = _StepInFlight(plan.step_id, what)
        self._in_flight.append(step)
        if len(self._in_flight) == 1:
            self._start_deadline(step)
        # A stream that ends (a rank failed, or the connection went) fails the oldest step in
        # flight, which it did not answer: with a step launched before this one, that step.
        # NOTE: a write that races the rank's end of its stream fails with grpc's own INTERNAL
        # "Internal error from Core", which also replaces the call's status: the rank's reason
        # is then only in its own log.
        blamed = self._in_flight[0].what
        try:
            if len(streams) == 1:
                await self._on_rank_0(blamed, _write(streams[0], self._channels[0], data))
            else:
                await self._call_all(
                    blamed, [_write(stream, channel, data) for stream, channel in zip(streams, self._channels)]
                )
        except BaseException:
            step.cancel_deadline()
            self._in_flight.remove(step)
            raise
        return step

    def _start_deadline(self, step: _StepInFlight) -> None:
        """Start ``step``'s deadline: it is the oldest in flight, the one the ranks work on now.

        NOTE: one timer per step rather than a deadline per call: the streams outlive every
        step.  It runs until the step's answer; the steps queued behind it wait for theirs.
        """
        step.deadline = asyncio.get_running_loop().call_later(self.step_timeout_s, self._expire, step.what)

    async def _receive(self, step: _StepInFlight) -> StepResult:
        """Every rank's answer to ``step``, the oldest in flight; rank 0's samples."""
        if not self._in_flight or self._in_flight[0] is not step:
            raise RuntimeError(f"replica {self.replica_id}: {step.what}'s result was asked for out of order")
        what = step.what
        try:
            self._check_usable()  # a step in flight with one that failed never ran
            if len(self._streams) == 1:
                replies = [await self._on_rank_0(what, _read(self._streams[0], self._channels[0]))]
            else:
                replies = await self._call_all(
                    what, [_read(stream, channel) for stream, channel in zip(self._streams, self._channels)]
                )
        finally:
            step.cancel_deadline()
            self._in_flight.popleft()
            if self._in_flight and self._failure is None:  # a failed replica's steps get no answer
                self._start_deadline(self._in_flight[0])
        if self._expired is not None:  # the timer fired just as the answers came
            self._fail(self._expired)
        try:
            result = decode_result(replies[0])
        except ValueError as exc:
            self._fail(f"replica {self.replica_id} rank 0 answered {what} with a malformed result: {exc}")
        if result is None or result.step_id != step.step_id:
            self._fail(f"replica {self.replica_id} rank 0 did not answer {what} with its samples")
        return result

    async def shutdown(self) -> None:
        """Ask every rank to release its worker (best effort), then close the channels."""
        if self._closed:
            return
        self._closed = True
        # A failed replica may have ranks stuck in a collective: they would not answer.
        if self._failure is None:
            # A rank serves one call at a time: its step stream ends before Shutdown.
            closing = [stream.done_writing() for stream in self._streams]
            await asyncio.gather(*closing, return_exceptions=True)
            calls = [
                stub.Shutdown(step_pb2.Empty(), timeout=_SHUTDOWN_TIMEOUT_S, metadata=self._metadata)
                for stub in self._stubs
            ]
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
            # NOTE: DEBUG: the scheduler actor logs the failure, with this message, as its one error.
            logger.debug("%s", message)
        self._cancel_streams()
        raise ReplicaFailedError(message)

    def _open_streams(self) -> list[grpc.aio.StreamStreamCall]:
        self._streams = [open_call(metadata=self._metadata) for open_call in self._open_calls]
        return self._streams

    def _cancel_streams(self) -> None:
        for stream in self._streams:
            stream.cancel()

    def _expire(self, what: str) -> None:
        """The step deadline passed: fail the step (its awaits see their streams cancelled)."""
        self._expired = f"replica {self.replica_id} did not answer {what} within {self.step_timeout_s:g} s"
        self._cancel_streams()

    async def _on_rank_0(self, what: str, call: Awaitable[T]) -> T:
        """``call`` on the stream of a replica's only rank, without a task per step as ``_call_all`` makes."""
        try:
            return await call
        except asyncio.CancelledError:
            if self._expired is not None:
                self._fail(self._expired)
            self._cancelled_in_flight(what)
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the stream fails the replica
            self._fail(f"replica {self.replica_id} rank 0 failed at {what}: {_describe(exc)}")

    def _cancelled_in_flight(self, what: str) -> None:
        # The workers may be ahead of the scheduler now: the replica cannot go on.
        self._failure = self._failure or f"replica {self.replica_id}: {what} was cancelled in flight"
        self._cancel_streams()

    async def _call_all(self, what: str, calls: Sequence[Awaitable]) -> list:
        """Await one call per rank; the first failure cancels the rest and fails the replica."""
        tasks = [asyncio.ensure_future(call) for call in calls]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            self._cancelled_in_flight(what)
            raise
        if self._expired is not None:
            self._fail(self._expired)
        failures = [
            (rank, task.exception())
            for rank, task in enumerate(tasks)
            if task.done() and not task.cancelled() and task.exception() is not None
        ]
        if failures:
            for task in tasks:
                task.cancel()
            rank, exc = failures[0]
            self._fail(f"replica {self.replica_id} rank {rank} failed at {what}: {_describe(exc)}")
        return [task.result() for task in tasks]


class _StreamBroken(Exception):
    """A rank's step stream ended or broke; the message is ``CODE: details``."""


async def _write(stream: grpc.aio.StreamStreamCall, channel: grpc.aio.Channel, data: bytes) -> None:
    """Send one serialized plan on ``stream`` (of ``channel``)."""
    if stream.done():
        # It ended between two steps (the rank stopped or died): its status says why.
        raise _StreamBroken(f"{(await stream.code()).name}: {await stream.details()}")
    try:
        await stream.write(data)
    except grpc.aio.AioRpcError as exc:
        lost = _lost_connection(exc, channel)
        if lost is None:
            raise
        raise lost from exc


async def _read(stream: grpc.aio.StreamStreamCall, channel: grpc.aio.Channel) -> step_pb2.StepResult:
    """The next result on ``stream`` (of ``channel``)."""
    try:
        reply = await stream.read()
    except grpc.aio.AioRpcError as exc:
        lost = _lost_connection(exc, channel)
        if lost is None:
            raise
        raise lost from exc
    if reply is grpc.aio.EOF:
        raise _StreamBroken("UNAVAILABLE: the rank ended its step stream")
    return reply


def _lost_connection(exc: grpc.aio.AioRpcError, channel: grpc.aio.Channel) -> _StreamBroken | None:
    """What ``exc`` means when the connection is gone, else ``None``.

    NOTE: a write that races the loss of the connection fails with grpc's own
    INTERNAL "Internal error from Core": the cause is the lost connection.
    """
    if exc.code() is grpc.StatusCode.INTERNAL and channel.get_state() is not grpc.ChannelConnectivity.READY:
        return _StreamBroken(f"UNAVAILABLE: the connection to the rank was lost ({exc.details()})")
    return None


@dataclass(slots=True)
class _StepInFlight:
    step_id: int
    what: str
    deadline: asyncio.TimerHandle | None = None  # started when it is the oldest in flight

    def cancel_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()


@dataclass(frozen=True, slots=True)
class PendingGrpcStep:
    """A step sent to a replica's ranks; ``await result()`` for its samples (in launch order)."""

    executor: GrpcReplicaExecutor
    step: _StepInFlight

    async def result(self) -> StepResult:
        return await self.executor._receive(self.step)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, _StreamBroken):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
