"""Starting a failed replica's workers again, with backoff between tries, until they start.

The scheduler actor takes a failed replica out of service and calls ``restart``
in the background: it releases the workers and ``relaunch`` starts new ones,
waiting before each try and doubling the wait after every failed one, up to
``MAX_RESTART_BACKOFF_S``.  It never gives up while the cluster runs (a node that
rebooted comes back, and so does its replica).  A failed try is a warning up to
the ``MAX_RESTART_TRIES``-th, which is one error saying that it keeps trying;
later ones are INFO lines.  A try that waits for a node with room (the replica's
node was lost) says so every ``STILL_WAITING_REPORT_S``.  What it launched is then
put into service (its step loop, an empty prefix cache).

The first wait after a failure is ``RestartBackoff.first_delay_s``: the base,
``RESTART_BACKOFF_S``, for a replica that served ``STABLE_SERVICE_S`` or longer
(or never failed before); a replica that fails sooner after it came back is
crash-looping, and waits twice as long as the try that brought it back did
(capped), so that it is not restarted every second forever::

    failure, then tries after   1 s (fails), 2 s (starts)   → served 10 s, fails again
    next restart's first try    4 s                         → served 5 min, fails again
    next restart's first try    1 s
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.cluster.replica_launcher import ReplicaHandle

if TYPE_CHECKING:
    # NOTE: for annotations only: an ActorReplica keeps its RestartBackoff.
    from kvserve.cluster.actor_replica import ActorReplica

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = 1.0
MAX_RESTART_BACKOFF_S = 60.0
# Failed tries told as warnings; then one error, and the tries go on (see the module docstring).
MAX_RESTART_TRIES = 5
# A replica that served this long before it failed is not crash-looping.
STABLE_SERVICE_S = 60.0
# While a try waits for a node with room (a lost node; without --placement-timeout it waits
# as long as it takes), a WARNING this often says so.
STILL_WAITING_REPORT_S = 60.0


@dataclass(slots=True)
class RestartBackoff:
    """One replica's restart delays across its failures (its ActorReplica keeps it; a replacement takes it over)."""

    # The wait before the try that last brought the replica back; None: it was never restarted.
    last_delay_s: float | None = None

    def first_delay_s(self, served_s: float) -> float:
        """The wait before the first try after a failure of a replica that had served ``served_s`` seconds."""
        if self.last_delay_s is None or served_s >= STABLE_SERVICE_S:
            return RESTART_BACKOFF_S
        return min(2 * self.last_delay_s, MAX_RESTART_BACKOFF_S)


@dataclass(frozen=True, slots=True)
class Relaunched:
    """What ``relaunch`` started: the workers, on which try, after waiting how long before that try."""

    handle: ReplicaHandle
    attempt: int
    delay_s: float


async def restart(
    failed: ActorReplica,
    *,
    launch: Callable[[], Awaitable[ReplicaHandle]],
    install: Callable[[ReplicaHandle], object],
    stopping: Callable[[], bool],
) -> None:
    """Release ``failed``'s workers, start new ones (``relaunch``, with ``failed``'s backoff; its restart
    tries that failed are counted in it), and ``install`` them (put them in service), unless ``stopping()``."""
    failed_at = time.monotonic()
    await failed.release()

    def count_failed_try() -> None:
        failed.num_restart_failures += 1

    relaunched = await relaunch(
        failed.replica_id,
        launch,
        stopping,
        first_delay_s=failed.backoff.first_delay_s(served_s=failed_at - failed.started_at),
        on_failed_try=count_failed_try,
    )
    if relaunched is None:
        return
    failed.backoff.last_delay_s = relaunched.delay_s
    install(relaunched.handle)
    # NOTE: a warning, as its failure was an error: an operator sees the incident end too.
    logger.warning(
        "replica %d is back in service (try %d, %.1f s after it failed)",
        failed.replica_id, relaunched.attempt, time.monotonic() - failed_at,
    )


async def relaunch(
    replica_id: int,
    launch: Callable[[], Awaitable[ReplicaHandle]],
    stopping: Callable[[], bool],
    *,
    first_delay_s: float,
    on_failed_try: Callable[[], None] = lambda: None,
) -> Relaunched | None:
    """Replica ``replica_id``'s workers from ``launch()``, tried until a try starts them, the first after
    ``first_delay_s``; ``None`` when ``stopping()`` (the cluster shuts down) before a try or after it (what
    that try started is shut down).  ``on_failed_try`` is called after each try that failed (a counter)."""
    delay_s = first_delay_s
    attempt = 0
    while True:
        attempt += 1
        await asyncio.sleep(delay_s)
        if stopping():
            return None
        logger.info("replica %d: starting again (try %d)", replica_id, attempt)
        try:
            handle = await launch()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed try is logged and tried again
            on_failed_try()
            next_delay_s = min(2 * delay_s, MAX_RESTART_BACKOFF_S)
            _log_failed_try(replica_id, attempt, exc, next_delay_s)
            delay_s = next_delay_s
            continue
        if stopping():
            await handle.shutdown()
            return None
        return Relaunched(handle, attempt, delay_s)


def _log_failed_try(replica_id: int, attempt: int, exc: Exception, next_delay_s: float) -> None:
    """A warning for each of the first tries, one error once ``MAX_RESTART_TRIES`` failed, INFO after that."""
    if attempt < MAX_RESTART_TRIES:
        level, message = logging.WARNING, "replica %d: try %d to start again failed: %s; next try in %g s"
    elif attempt == MAX_RESTART_TRIES:
        level, message = logging.ERROR, (
            "replica %d is still down: try %d to start again failed: %s; it keeps trying, next in %g s, "
            f"then every {MAX_RESTART_BACKOFF_S:g} s at most, until it starts"
        )
    else:
        level, message = logging.INFO, "replica %d: try %d to start again failed: %s; next try in %g s"
    logger.log(level, message, replica_id, attempt, exc, next_delay_s)
