"""kvserve's log lines: one format, for ``kvserve serve``'s own process and the actors it starts."""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class OneLineFormatter(logging.Formatter):
    """``LOG_FORMAT``, each record's message on one line: Ray's exceptions name the dead actor on lines of
    their own (``\tclass_name: WorkerActor``), which a journal or a log reader took for other records.
    A traceback (a bug's ``exc_info``) keeps its lines."""

    def __init__(self) -> None:
        super().__init__(LOG_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        line = super().formatMessage(record)
        return " ".join(line.split()) if "\n" in line else line


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
        handler.setFormatter(OneLineFormatter())
        package.addHandler(handler)
        package.propagate = False
