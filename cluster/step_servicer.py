"""The worker side of the step protocol: a StepWorker gRPC server around one rank.

The server is grpc's threaded server, not ``grpc.aio``.  Every call into the
runner runs on the rank's worker thread (torch.distributed collectives require
one thread; so does the device context of a GPU); the RPCs themselves are
served on a thread of the server's own::

    scheduler ──ExecuteSteps stream──▶ reader thread: parse, decode_plan
                                       worker thread: runner.launch / runner.execute, in order
    scheduler ◀──── StepResult ─────── RPC thread: the step's result, encode_result, the send

So the worker thread does the steps and nothing else: it starts the next plan the
scheduler sent (overlapped scheduling sends steps ahead, ``EngineCore.steps_ahead``)
as soon as it finished the one before, while another thread answers that one.  A
streamed answer's send waits for grpc's completion (some 150 us on a loaded 2-core
machine), and the decoding of a plan of 64 requests takes some 100 us: on the worker
thread they came between two launches; here they run beside them (the torch ops of
a launch let go of the GIL).  A runner whose ``launches_ahead`` is true (a CUDA
worker) returns from ``launch`` before the device ran the step: a helper thread
waits for the device, then the step is answered.

NOTE: RPCs are served one at a time, on one RPC thread.  The scheduler of the rank's
replica keeps one ``ExecuteSteps`` stream open and ends it before it calls ``Shutdown``;
any other call waits until that stream ends.

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
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import grpc

from kvserve.cluster.auth import TokenTable
from kvserve.cluster.grpc_auth import ThreadedBearerTokenInterceptor
from kvserve.cluster.step_codec import decode_plan, encode_result
from kvserve.proto import step_pb2, step_pb2_grpc
from kvserve.scheduler.checks import SettingError, check_num_blocks
from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult

logger = logging.getLogger(__name__)

T = TypeVar("T")

# One: a rank serves one call at a time (a second step stream waits for the first to end, and
# Shutdown for the stream's steps), as when the worker thread served the calls itself.
_RPC_THREADS = 1

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
    device ran it, ``result()`` gives its result (both from any thread).
    """

    def determine_num_blocks(self) -> int: ...

    def initialize_cache(self, num_blocks: int) -> None: ...

    def execute(self, plan: StepPlan) -> StepResult | None: ...

    def shutdown(self) -> None: ...


class StepWorkerServicer(step_pb2_grpc.StepWorkerServicer):
    """Serves one rank's ``StepRunner``; every call into it runs on ``thread``, the rank's worker thread."""

    def __init__(self, runner: StepRunner, thread: ThreadPoolExecutor) -> None:
        self._runner = runner
        self._thread = thread

    def _run(self, context: grpc.ServicerContext, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the worker thread; a failure is answered ``INTERNAL``."""
        return _reported(context, getattr(fn, "__name__", fn), self._thread.submit(fn, *args).result)

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
        """Each plan of the stream goes to the worker thread as it comes, queued behind the steps
        before it; each step is answered, in order, as soon as it ran.

        Two helper threads turn the stream's plans and the steps' ends into one queue of events.
        """
        launches_ahead = bool(getattr(self._runner, "launches_ahead", False))
        step = self._runner.launch if launches_ahead else self._runner.execute  # type: ignore[attr-defined]
        events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        to_wait: queue.SimpleQueue[Future | None] = queue.SimpleQueue()
        threading.Thread(target=_read_into, args=(request_iterator, events), daemon=True, name="step-reader").start()
        threading.Thread(target=_wait_into, args=(to_wait, events, launches_ahead), daemon=True,
                         name="step-waiter").start()
        in_flight: deque[tuple[int, Future]] = deque()  # steps started and not yet answered, oldest first
        ended = False
        try:
            while not (ended and not in_flight):
                kind, item = events.get()
                if kind == "plan":
                    plan = _decoded(item, context)
                    future = self._thread.submit(step, plan)
                    in_flight.append((plan.step_id, future))
                    to_wait.put(future)
                elif kind == "ran":
                    step_id, future = in_flight.popleft()
                    answer = future.result().result if launches_ahead else future.result
                    yield encode_result(step_id, _reported(context, step.__name__, answer))
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


def _reported(context: grpc.ServicerContext, what: object, call: Callable[[], T]) -> T:
    """``call()``; a failure (of ``what``) is logged and answered ``INTERNAL``."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - reported to the caller, the server keeps serving
        if is_peer_failure(exc) or isinstance(exc, SettingError):
            # NOTE: another rank died (its own log and the scheduler's say why), or a setting cannot
            # work here (its message says how): a traceback would be noise (some 60 lines of a
            # collective's, or 20 that lead to the check).
            logger.error("%s failed: %s", what, one_line(exc))
            logger.debug("%s failed", what, exc_info=True)
        else:
            logger.exception("%s failed: %s", what, one_line(exc))
        context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        raise  # context.abort raises; for the type checker


def _decoded(decoded: tuple[step_pb2.StepPlan, StepPlan | ValueError], context: grpc.ServicerContext) -> StepPlan:
    """The plan ``_read_into`` decoded; a malformed one ends the stream with ``INVALID_ARGUMENT``."""
    request, plan = decoded
    if isinstance(plan, ValueError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {request.step_id}: {plan}")
        raise plan  # context.abort raises; for the type checker
    return plan


def _read_into(request_iterator: Iterable[step_pb2.StepPlan], events: queue.SimpleQueue) -> None:
    """Put ("plan", (message, its plan or why it is malformed)) into ``events`` for every plan of the
    stream as it comes, then ("end", None).

    NOTE: decoded here, beside the worker thread's launch of the step before (whose torch ops let
    go of the GIL), rather than on the worker thread between two launches.
    """
    try:
        for request in request_iterator:
            try:
                plan: StepPlan | ValueError = decode_plan(request)
            except ValueError as exc:
                plan = exc
            events.put(("plan", (request, plan)))
    except Exception:  # noqa: BLE001 - a cancelled or broken stream ends like a finished one
        pass
    finally:
        events.put(("end", None))


def _wait_into(to_wait: queue.SimpleQueue, events: queue.SimpleQueue, launches_ahead: bool) -> None:
    """For each step of ``to_wait`` (its future on the worker thread; until ``None``), in order:
    wait until it ran (``launches_ahead``: until the device ran it too), then put ("ran", None)
    into ``events``; its answer raises any failure where it is answered."""
    while (future := to_wait.get()) is not None:
        try:
            done = future.result()
            if launches_ahead:
                done.wait()
        except Exception:  # noqa: BLE001 - raised where it is answered
            pass
        events.put(("ran", None))


class StepServer:
    """A started StepWorker server; ``stop`` it from the event loop that started it."""

    def __init__(self, server: grpc.Server, rpc_threads: ThreadPoolExecutor) -> None:
        self._server = server
        self._rpc_threads = rpc_threads

    async def stop(self, grace: float | None = None) -> None:
        """Cancel the calls in flight after ``grace`` seconds (at once for ``None``) and close."""
        await asyncio.to_thread(self._server.stop(grace).wait)
        self._rpc_threads.shutdown(wait=False)


async def start_step_server(
    runner: StepRunner, thread: ThreadPoolExecutor, host: str, *, secret: str
) -> tuple[StepServer, str]:
    """Start a StepWorker server for ``runner`` on ``host`` and a free port; returns it and ``host:port``.

    ``thread`` is the rank's worker thread, a ``ThreadPoolExecutor`` of one
    thread: every call into ``runner`` runs there.  Every call must carry
    ``secret`` (module docstring).
    """
    if not secret:
        raise ValueError("a StepWorker server's secret must not be empty")
    interceptor = ThreadedBearerTokenInterceptor(TokenTable({secret: "replica"}))
    rpc_threads = ThreadPoolExecutor(max_workers=_RPC_THREADS, thread_name_prefix="kvserve-step-rpc")
    server = grpc.server(rpc_threads, interceptors=[interceptor], options=GRPC_OPTIONS)
    step_pb2_grpc.add_StepWorkerServicer_to_server(StepWorkerServicer(runner, thread), server)
    port = server.add_insecure_port(join_host_port(host, 0))
    if port == 0:
        raise RuntimeError(f"could not bind a StepWorker server on {host}")
    server.start()
    return StepServer(server, rpc_threads), join_host_port(host, port)


def join_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
