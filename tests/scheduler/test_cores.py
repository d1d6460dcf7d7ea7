import os
import subprocess
import sys

import pytest

from kvserve.scheduler.cores import available_cores


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs CPU affinity and at least 2 usable cores (with 1, the machine's count could pass too)",
)
def test_available_cores_are_those_of_the_process_affinity_not_the_machines() -> None:
    # A container or taskset gives a process fewer cores than os.cpu_count(): threads sized
    # for the machine (a rank's torch threads) would spin against each other.
    one_core = min(os.sched_getaffinity(0))
    script = (
        "import os; from kvserve.scheduler.cores import available_cores\n"
        f"os.sched_setaffinity(0, {{{one_core}}}); print(available_cores(), os.cpu_count())"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    restricted, machine = map(int, out.split())
    assert restricted == 1
    assert machine == os.cpu_count()
    assert available_cores() == len(os.sched_getaffinity(0))
