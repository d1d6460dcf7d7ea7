"""The scheduler actor's watchdog of outputs nobody fetches.

A front end that stopped or died without aborting its requests leaves them
running, their outputs piling up in the ``OutputMailbox`` and their blocks taken.
Once no front end fetched outputs for ``timeout_s``, the watchdog aborts the
requests whose outputs wait, and drops those outputs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvserve.cluster.output_mailbox import OutputMailbox

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 1.0


async def watch_undelivered_outputs(
    outputs: OutputMailbox, timeout_s: float, abort: Callable[[list[str]], None]
) -> None:
    """Every ``WATCHDOG_INTERVAL_S`` (or ``timeout_s`` if shorter), ``abort`` the requests whose outputs
    nobody fetched for ``timeout_s``; runs until cancelled."""
    while True:
        await asyncio.sleep(min(WATCHDOG_INTERVAL_S, timeout_s))
        idle_s = outputs.unfetched_s()
        if idle_s < timeout_s:
            continue
        req_ids = list(outputs.pending)
        logger.warning("no front end fetched outputs for %.0f s: aborting %d requests", idle_s, len(req_ids))
        abort(req_ids)
        outputs.pending.clear()
