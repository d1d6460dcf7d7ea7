"""Starting a failed replica's workers again, with backoff between tries.

The scheduler actor takes a failed replica out of service and calls ``relaunch``
in the background: it waits ``RESTART_BACKOFF_S`` seconds, then launches the
workers again, doubling the wait after every failed try, up to
``MAX_RESTART_TRIES`` tries.  The actor then puts what it launched into service
(its step loop, an empty prefix cache).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kvserve.cluster.replica_launcher import ReplicaHandle

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = 1.0
MAX_RESTART_TRIES = 5


async def relaunch(
    replica_id: int, launch: Callable[[], Awaitable[ReplicaHandle]], stopping: Callable[[], bool]
) -> tuple[ReplicaHandle, int] | None:
    """Replica ``replica_id``'s workers from ``launch()``, and the try that started them;
    ``None`` once ``MAX_RESTART_TRIES`` tries failed, or when ``stopping()`` (the cluster
    shuts down) before a try or after it (what that try started is shut down)."""
    delay_s = RESTART_BACKOFF_S
    for attempt in range(1, MAX_RESTART_TRIES + 1):
        await asyncio.sleep(delay_s)
        if stopping():
            return None
        logger.info("replica %d: starting again (try %d of %d)", replica_id, attempt, MAX_RESTART_TRIES)
        try:
            handle = await launch()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed try is logged and tried again
            logger.warning("replica %d: try %d to start again failed: %s", replica_id, attempt, exc)
            delay_s *= 2
            continue
        if stopping():
            await handle.shutdown()
            return None
        return handle, attempt
    logger.error("replica %d stays down: %d tries to start it again failed", replica_id, MAX_RESTART_TRIES)
    return None
