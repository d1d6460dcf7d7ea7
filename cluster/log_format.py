"""kvserve's log lines: one format, for ``kvserve serve``'s own process and the actors it starts."""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def show_logs(level: int) -> None:
    """Write this process's ``kvserve`` log records of ``level`` and above to stderr (which Ray
    forwards to the driver's terminal), with their time, level and logger, as the server writes its own.

    NOTE: Ray gives an actor's process no handler: only Python's last-resort handler wrote its
    records, those of WARNING and above, bare; ``--log-level info`` showed none of the actor's.
    """
    package = logging.getLogger("kvserve")
    package.setLevel(level)
    if not package.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        package.addHandler(handler)
        package.propagate = False
