"""A share of a simulated fleet's replicas, stepped by a process of its own.

The router needs every replica's state only when a request arrives, and
between two arrivals the replicas do not interact: each steps on its own.
So ``FleetSimulator(processes=N)`` gives ``N - 1`` child processes a share
of the replicas each (``SimulatedReplicas``) and, for each arrival at ``t``:

    main                                   each shard process
    send (requests routed to it, t)  --->  add them (at their arrival times)
    advance its own replicas to t          advance its replicas to t
    apply the shards' events         <---  pool and queue events, the steps in
    route the request at t                 flight and load changes since the last
                                           message, in order

After the last arrival every process runs its replicas to completion on its
own, the shards sending their counts of finished requests as they go.

Per replica, events are applied in the order they happened, and the index
and the load table depend on each replica's events alone, so the router
sees at each arrival exactly what the one-process simulation shows it: the
results are identical, record for record.

The shard processes are forked, so that they hold the workload as this
process does: a request routed to a shard travels as its index and block
hashes.  NOTE: sent whole, a prompt of 2,000 tokens arrived as 2,000 new
int objects (pickle shares none), and receiving and holding them made the
shard's steps a third slower than the main process's.

The messages are pickled tuples; a failure in a shard (a request it cannot
serve, a stall) comes back as the same exception type with its message.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import math
import multiprocessing
import operator
import os
import select
import signal
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from kvserve.scheduler.block_hash import BlockHash, num_cacheable_blocks
from kvserve.scheduler.routing.queue_tracker import StepsInFlight
from kvserve.scheduler.scheduler_load import SchedulerLoad
from kvserve.scheduler.simulation.admission import Admission
from kvserve.scheduler.simulation.fleet import FleetConfig, RequestRecord, SimulatedRequest
from kvserve.scheduler.simulation.simulated_replicas import SimulatedReplicas

# Event codes: a replica's pool stored blocks, removed blocks, or cleared its prefix cache;
# its scheduler queued a request (req_id, block hashes, num_tokens) or took one out of the queue (req_id).
STORED, REMOVED, CLEARED, QUEUED, DEQUEUED = 0, 1, 2, 3, 4

# Messages to a shard, and from it.
_STEP, _FINISH = "step", "finish"
_OK, _PROGRESS, _ERROR = "ok", "progress", "error"
# A load travels as its fields' values, in SchedulerLoad's order.
_pack_load = operator.attrgetter(*(field.name for field in dataclasses.fields(SchedulerLoad)))

# What the main process sends of a request routed to a shard: (index in the workload, replica, block hashes).
RoutedRequest = tuple[int, int, list[BlockHash]]
# A shard's report: [(replica, event code, payload)], [(replica, prefill tokens of the step in flight)],
# [(replica, load fields)], requests finished.
StepReport = tuple[list[tuple[int, int, Any]], list[tuple[int, int]], list[tuple[int, tuple[int, ...]]], int]

_EXCEPTIONS: dict[str, type[Exception]] = {"ValueError": ValueError, "RuntimeError": RuntimeError}


def unpack_load(fields: tuple[int, ...]) -> SchedulerLoad:
    return SchedulerLoad(*fields)


class ShardFailedError(RuntimeError):
    """A shard process died without reporting an error (killed, out of memory)."""


class ReplicaShard:
    """The main process's handle on one shard process: replicas ``replica_ids`` of ``config``.

    ``requests`` is the workload (the shard process inherits it).  ``spin``:
    both sides spin briefly while they wait for each other (only when every
    process of the simulation has a core of its own).
    """

    def __init__(
        self,
        config: FleetConfig,
        replica_ids: Sequence[int],
        requests: Sequence[SimulatedRequest],
        *,
        spin: bool,
    ) -> None:
        context = multiprocessing.get_context("fork")
        self._conn, child_conn = context.Pipe()
        self.replica_ids = list(replica_ids)
        self._process = context.Process(
            target=_serve,
            args=(child_conn, config, self.replica_ids, requests, spin, os.getpid()),
            name="kvserve-sim-shard",
            daemon=True,
        )
        self._process.start()
        child_conn.close()
        self._wait = _Waiter(self._conn, spin)
        # A message receive_finish is to return, read early by poll_progress.
        self._final: tuple | None = None

    def initial_loads(self) -> list[tuple[int, tuple[int, ...]]]:
        """The loads of the shard's replicas once built (the first message it sends)."""
        return self._receive()[1]

    def send_step(self, requests: list[RoutedRequest], until: float) -> None:
        """Add ``requests`` (routed to the shard's replicas), then advance to ``until``;
        ``receive_step`` returns what happened."""
        self._send((_STEP, requests, until))

    def receive_step(self) -> StepReport:
        return self._receive()[1]

    def send_finish(self, requests: list[RoutedRequest], progress_every: int) -> None:
        """Add ``requests``, then run every replica to completion, saying how many requests
        it has finished every ``progress_every``; ``receive_finish`` returns the results."""
        self._send((_FINISH, requests, progress_every))

    def poll_progress(self) -> int | None:
        """The shard's latest count of finished requests since ``send_finish``, if it sent one
        since the last call (never blocks)."""
        count = None
        while self._final is None and self._wait.ready():
            message = self._receive()
            if message[0] == _PROGRESS:
                count = message[1]
            else:
                self._final = message
        return count

    def receive_finish(
        self, on_progress: Callable[[int], None]
    ) -> tuple[list[RequestRecord], list[tuple[int, float, int, int]], float]:
        """The records of the requests the shard finished, (replica, busy time, steps, requests
        routed) for each of its replicas, and the time of its last event; ``on_progress(count)``
        on each count of finished requests the shard sends meanwhile."""
        while True:
            message, self._final = self._final or self._receive(), None
            if message[0] != _PROGRESS:
                return message[1]
            on_progress(message[1])

    def close(self) -> None:
        """Stop the process if it still runs."""
        self._conn.close()
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=5)
            if self._process.is_alive():
                self._process.kill()
        self._process.join()

    def _send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except OSError:  # BrokenPipeError, ConnectionResetError: it died
            raise self._failure() from None

    def _receive(self) -> Any:
        try:
            self._wait()
            message = self._conn.recv()
        except (EOFError, OSError):
            raise self._failure() from None
        if message[0] == _ERROR:
            name, text = message[1]
            raise _EXCEPTIONS.get(name, RuntimeError)(text)
        return message

    def _failure(self) -> ShardFailedError:
        self._process.join(timeout=5)
        return ShardFailedError(
            f"the simulation process of replicas {self.replica_ids[0]}..{self.replica_ids[-1]} died "
            f"(exit code {self._process.exitcode})"
        )


def _serve(
    conn: Connection,
    config: FleetConfig,
    replica_ids: list[int],
    requests: Sequence[SimulatedRequest],
    spin: bool,
    parent_pid: int,
) -> None:
    """The shard process: build the replicas, then answer step and finish messages."""
    # The main process stops the shard (it terminates it): Ctrl-C is the main process's to handle,
    # and a SIGTERM handler inherited from it (kvserve's commands turn SIGTERM into Ctrl-C) is not ours.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(parent_pid)
    # The fleet makes no reference cycles per step (see simulator._cyclic_gc_paused).
    gc.disable()
    try:
        events: list[tuple[int, int, Any]] = []
        inflight: dict[int, int] = {}
        loads: dict[int, SchedulerLoad] = {}
        block_size = config.cache_config.block_size
        replicas = SimulatedReplicas(
            config,
            replica_ids,
            lambda replica_id: _EventBuffer(replica_id, events),
            lambda replica_id: _QueueEventBuffer(replica_id, events, inflight, block_size),
            loads.__setitem__,
        )
        conn.send((_OK, _drain_loads(loads)))
        events.clear()
        inflight.clear()
        admission = Admission(config)
        wait = _Waiter(conn, spin)
        while True:
            wait()
            kind, routed, until_or_every = conn.recv()
            # Routed at the arrival the last message advanced these replicas to.
            for index, replica_id, block_hashes in routed:
                item = requests[index]
                request = admission.request(index, item)
                request.block_hashes = block_hashes
                replicas.add(request, replica_id, item.arrival_time)
            if kind == _FINISH:
                replicas.set_progress(lambda count, _: conn.send((_PROGRESS, count)), until_or_every, 0)
                replicas.advance(math.inf)
                replicas.check_all_finished()
                totals = [
                    (r, replicas.busy_time[r], replicas.num_steps[r], replicas.num_routed[r]) for r in replica_ids
                ]
                conn.send((_OK, (replicas.records, totals, replicas.now)))
                return
            replicas.advance(until_or_every)
            conn.send((_OK, (events.copy(), list(inflight.items()), _drain_loads(loads), replicas.num_finished)))
            events.clear()
            inflight.clear()
    except Exception as exc:  # noqa: BLE001  # reported to the main process, which raises it
        conn.send((_ERROR, (type(exc).__name__, str(exc))))
    finally:
        conn.close()
        # NOTE: leave at once, running nothing on the way out.  In the test
        # process, after tests that had run Ray there, a shard that returned
        # from here never exited (whatever it ran of its parent's inherited
        # state on its way out hung), and the main process waited for it for good.
        os._exit(0)


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux), else a shard whose main
    process was killed (SIGKILL, out of memory) simulated on, orphaned, to the end of its run."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the shard ends at its next message instead
        return
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(0)


_PR_SET_PDEATHSIG = 1


class _Waiter:
    """Waits until ``conn`` has a message: spinning at first, when ``spin``, then blocking.

    NOTE: the two sides of a shard wait for each other at every arrival, for
    a few hundred microseconds each time.  A process that blocks gives its
    core back, and on a virtual machine the wake-up that follows cost more
    than the wait: with blocking waits, two processes simulated a fleet
    slower than one (34 s against 31 s for 10k requests on 1,000 replicas;
    20.6 s spinning).  A spin holds a core, so only with a core per process,
    and for at most ``SPIN_SECONDS`` before blocking (the long last wait).
    """

    SPIN_SECONDS = 0.01

    __slots__ = ("_conn", "_poll", "_spin")

    def __init__(self, conn: Connection, spin: bool) -> None:
        self._conn = conn
        self._spin = spin
        self._poll = select.poll()
        self._poll.register(conn.fileno(), select.POLLIN)

    def ready(self) -> bool:
        """Whether a message waits (never blocks)."""
        return bool(self._poll.poll(0))

    def __call__(self) -> None:
        if self._spin:
            poll = self._poll.poll
            if poll(0):
                return
            deadline = time.perf_counter() + self.SPIN_SECONDS
            while time.perf_counter() < deadline:
                if poll(0):
                    return
        self._poll.poll()


def _drain_loads(loads: dict[int, SchedulerLoad]) -> list[tuple[int, tuple[int, ...]]]:
    packed = [(replica_id, _pack_load(load)) for replica_id, load in loads.items()]
    loads.clear()
    return packed


class _EventBuffer:
    """A replica pool's observer in a shard process: its events wait for the next report."""

    __slots__ = ("replica_id", "events")

    def __init__(self, replica_id: int, events: list[tuple[int, int, Any]]) -> None:
        self.replica_id = replica_id
        self.events = events

    def blocks_stored(self, block_hashes: list[BlockHash], block_ids: list[int]) -> None:
        self.events.append((self.replica_id, STORED, block_hashes))

    def blocks_removed(self, block_hashes: list[BlockHash], block_ids: list[int]) -> None:
        self.events.append((self.replica_id, REMOVED, block_hashes))

    def all_blocks_cleared(self) -> None:
        self.events.append((self.replica_id, CLEARED, []))


class _QueueEventBuffer:
    """A replica scheduler's queue observer in a shard process: its events wait for the next report.

    A queued request travels with the block hashes a lookup can use (never its
    last token's block); of the steps planned and applied only the last state
    counts (the prompt tokens of the steps in flight, as ``QueueTracker`` sums
    them), so it is kept per replica (``inflight``), not as events.
    """

    __slots__ = ("replica_id", "events", "inflight", "block_size", "_steps")

    def __init__(
        self, replica_id: int, events: list[tuple[int, int, Any]], inflight: dict[int, int], block_size: int
    ) -> None:
        self.replica_id = replica_id
        self.events = events
        self.inflight = inflight
        self.block_size = block_size
        self._steps = StepsInFlight()

    def request_queued(self, req_id: str, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        cacheable = list(block_hashes[: num_cacheable_blocks(num_tokens, self.block_size)])
        self.events.append((self.replica_id, QUEUED, (req_id, cacheable, num_tokens)))

    def request_dequeued(self, req_id: str) -> None:
        self.events.append((self.replica_id, DEQUEUED, req_id))

    def step_planned(self, num_prefill_tokens: int) -> None:
        self._steps.planned(num_prefill_tokens)
        self.inflight[self.replica_id] = self._steps.num_prefill_tokens

    def step_applied(self) -> None:
        self._steps.ended()
        self.inflight[self.replica_id] = self._steps.num_prefill_tokens
