"""The host's cores this process may run on: its CPU affinity, not every core of the machine.

A container or ``taskset`` may give a process fewer cores than ``os.cpu_count()``
says; threads sized for the machine then spin against each other.
"""

from __future__ import annotations

import os


def available_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
