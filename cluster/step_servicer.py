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

A runner whose launches return before the device ran the step (a CUDA worker,
``launches_ahead``) gets the stream's plans through a second thread, which
only reads them: a plan already sent (overlapped scheduling sends step N+1
before step N's result came back) is launched before step N's result is
waited for, so the device goes from one step to the next without waiting for
the host.  A CPU worker computes the step in ``launch`` itself: it would gain
nothing, and keeps the one thread.

A malformed plan ends its stream with ``INVALID_ARGUMENT``, a failing step
with ``INTERNAL``; neither takes the server down.

Every call must carry its replica's secret (``authorization: Bearer <secret>``,
made by ``kvserve.cluster.replica_launcher`` and given to the rank and to the
scheduler's ``GrpcReplicaExecutor`` through Ray): any other caller on the
cluster network is answered ``UNAUTHENTICATED`` before its request is read,
and the rank keeps serving.  The secret travels once per call (once per step
stream), not with each step.  NOTE: the connection itself is plaintext, as
Ray's own traffic is by default: the secret and the steps can be read, and
the secret replayed, by whoever can watch the cluster network.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import re
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import grpc

from kvserve.cluster.auth import TokenTable
from kvserve.cluster.grpc_auth import ThreadedBearerTokenInterceptor
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
    """What the servicer drives: a ``kvserve.worker.worker.Worker`` (or a stand-in in benchmarks).

    A runner whose ``launches_ahead`` is true (a CUDA worker) also has ``launch(plan)``,
    which returns before the device ran the step: ``wait()`` on it blocks until the
    device ran it (from any thread), ``result()`` (on the worker thread) gives its result.
    """

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
            what = getattr(fn, "__name__", fn)
            if is_peer_failure(exc):
                # NOTE: another rank died (its own log and the scheduler's say why): a traceback of
                # the collective that noticed would be some 60 lines of noise.
                logger.error("%s failed: %s", what, one_line(exc))
                logger.debug("%s failed", what, exc_info=True)
            else:
                logger.exception("%s failed: %s", what, one_line(exc))
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
        if getattr(self._runner, "launches_ahead", False):
            yield from self._execute_launching_ahead(request_iterator, context)
            return
        execute = self._runner.execute
        for request in request_iterator:
            plan = _decode(request, context)
            yield encode_result(plan.step_id, self._run(context, execute, plan))

    def _execute_launching_ahead(
        self, request_iterator: Iterable[step_pb2.StepPlan], context: grpc.ServicerContext
    ) -> Iterator[step_pb2.StepResult]:
        """``ExecuteSteps`` for a runner whose ``launch`` returns before the device ran the step.

        Two helper threads turn the stream's plans and the device's progress into one queue of
        events: a plan that comes while a step runs is launched at once, and a step is answered
        as soon as the device ran it.  Every call into the runner stays on this thread.
        """
        events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        to_wait: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=_read_into, args=(request_iterator, events), daemon=True, name="step-reader").start()
        threading.Thread(target=_wait_into, args=(to_wait, events), daemon=True, name="step-waiter").start()
        launch = self._runner.launch  # type: ignore[attr-defined]
        in_flight: deque[tuple[int, Any]] = deque()  # launched steps not yet answered, oldest first
        ended = False
        try:
            while not (ended and not in_flight):
                kind, request = events.get()
                if kind == "plan":
                    plan = _decode(request, context)
                    launched = self._run(context, launch, plan)
                    in_flight.append((plan.step_id, launched))
                    to_wait.put(launched)
                elif kind == "ran":
                    step_id, launched = in_flight.popleft()
                    yield encode_result(step_id, self._run(context, launched.result))
                else:  # the stream ended: answer what is still in flight
                    ended = True
        finally:
            to_wait.put(None)

    def Shutdown(self, request: step_pb2.Empty, context: grpc.ServicerContext) -> step_pb2.Empty:
        self._run(context, self._runner.shutdown)
        return step_pb2.Empty()


# What torch.distributed's backends say when a peer rank went away (gloo: "Connection reset by
# peer", "Connection closed by peer ... a remote worker crashing"; NCCL: a communicator aborted).
_PEER_FAILURE = re.compile(
    r"(connection (reset|closed|refused)|broken pipe|remote worker crash|communicator was aborted|"
    r"remote process exited)",
    re.IGNORECASE,
)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says that a peer (another rank, the step stream's other end) went away,
    rather than that this rank's own code failed."""
    return isinstance(exc, ConnectionError) or _PEER_FAILURE.search(str(exc)) is not None


def one_line(exc: BaseException) -> str:
    """``Type: message``, its message cut at its first line (torch's may add a C++ stack)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _decode(request: step_pb2.StepPlan, context: grpc.ServicerContext) -> StepPlan:
    """The plan of ``request``; a malformed one ends the stream with ``INVALID_ARGUMENT``."""
    try:
        return decode_plan(request)
    except ValueError as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {request.step_id}: {exc}")
        raise  # context.abort raises; for the type checker


def _read_into(request_iterator: Iterable[step_pb2.StepPlan], events: queue.SimpleQueue) -> None:
    """Put ("plan", plan) into ``events`` for every plan of the stream as it comes, then ("end", None)."""
    try:
        for request in request_iterator:
            events.put(("plan", request))
    except Exception:  # noqa: BLE001 - a cancelled or broken stream ends like a finished one
        pass
    finally:
        events.put(("end", None))


def _wait_into(to_wait: queue.SimpleQueue, events: queue.SimpleQueue) -> None:
    """For each launched step of ``to_wait`` (until ``None``), in order: wait until the device ran
    it, then put ("ran", None) into ``events``; its ``result()``, on the worker thread, raises any failure."""
    while (launched := to_wait.get()) is not None:
        try:
            launched.wait()
        except Exception:  # noqa: BLE001 - result() raises it where it is answered
            pass
        events.put(("ran", None))


class StepServer:
    """A started StepWorker server; ``stop`` it from the event loop that started it."""

    def __init__(self, server: grpc.Server) -> None:
        self._server = server

    async def stop(self, grace: float | None = None) -> None:
        """Cancel the calls in flight after ``grace`` seconds (at once for ``None``) and close."""
        await asyncio.to_thread(self._server.stop(grace).wait)


async def start_step_server(
    runner: StepRunner, thread: ThreadPoolExecutor, host: str, *, secret: str
) -> tuple[StepServer, str]:
    """Start a StepWorker server for ``runner`` on ``host`` and a free port; returns it and ``host:port``.

    ``thread`` is the rank's worker thread, a ``ThreadPoolExecutor`` of one
    thread: the server runs every RPC on it, so every call into ``runner``
    runs there.  Every call must carry ``secret`` (module docstring).
    """
    if not secret:
        raise ValueError("a StepWorker server's secret must not be empty")
    interceptor = ThreadedBearerTokenInterceptor(TokenTable({secret: "replica"}))
    server = grpc.server(thread, interceptors=[interceptor], options=GRPC_OPTIONS)
    step_pb2_grpc.add_StepWorkerServicer_to_server(StepWorkerServicer(runner), server)
    port = server.add_insecure_port(join_host_port(host, 0))
    if port == 0:
        raise RuntimeError(f"could not bind a StepWorker server on {host}")
    server.start()
    return StepServer(server), join_host_port(host, port)


def join_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
