"""The memory-latency probe that the simulator benchmark prints beside its total."""

from __future__ import annotations

import math

import pytest

from kvserve.bench import simulator_scale
from kvserve.bench.memory_latency import object_read_times


def test_the_probe_times_reads_in_both_orders() -> None:
    times = object_read_times(num_objects=20_000, num_reads=5_000)

    assert math.isfinite(times.random_ns) and times.random_ns > 0
    assert math.isfinite(times.sequential_ns) and times.sequential_ns > 0


@pytest.mark.parametrize(("num_objects", "num_reads"), [(0, 0), (10, 0), (10, 11)])
def test_the_probe_needs_reads_within_its_objects(num_objects, num_reads) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="need 1 <= num_reads <= num_objects"):
        object_read_times(num_objects=num_objects, num_reads=num_reads)


def test_the_simulator_benchmark_prints_the_machines_read_time_beside_its_total(capsys) -> None:  # noqa: ANN001
    assert simulator_scale.main(["--replicas", "2", "--requests", "20", "--no-baseline"]) == 0
    out = capsys.readouterr().out

    figures = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.splitlines()[-3:]}
    assert float(figures["total seconds"]) >= 0  # printed to 0.1 s: a tiny fleet's run may show 0.0
    assert float(figures["ns per random object read"]) > 0
