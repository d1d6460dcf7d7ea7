"""The knee of round robin: the rate at which its TTFT p99 is a given multiple of its unloaded value."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvserve.experiments.experiment_knee import KneeNotFound, find_knee_qps
from kvserve.experiments.workloads import make_workload
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.routing.policies import make_policy
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.simulation.simulator import FleetConfig, FleetSimulator

NUM_REQUESTS = 200
FLEET = FleetConfig(
    num_replicas=2,
    scheduler_config=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=256),
    cache_config=CacheConfig(block_size=16, num_blocks=64),
    cost_model=StepCostModel.default(),
)


def stream_at(qps: float, num_requests: int):  # noqa: ANN201
    return make_workload(
        "shared_prefix", num_requests, qps, seed=0, num_groups=4, system_prompt_len=128, question_len=16, output_len=8
    )


def ttft_p99(qps: float, num_requests: int) -> float:
    """Round robin's TTFT p99 over the measured requests (a warm-up comes first)."""
    requests = stream_at(qps, num_requests)
    result = FleetSimulator(FLEET, make_policy("round_robin")).run(requests)
    return float(np.percentile([r.ttft for r in result.records if requests[r.index].measured], 99))


def test_the_knee_is_where_round_robins_ttft_p99_reaches_the_factor():
    lines: list[str] = []
    knee = find_knee_qps(stream_at, NUM_REQUESTS, FLEET, lambda: make_policy("round_robin"), 5.0, report=lines.append)

    unloaded = ttft_p99(0.01 * FLEET.num_replicas, NUM_REQUESTS)
    ratio = ttft_p99(knee, NUM_REQUESTS) / unloaded
    assert abs(math.log(ratio / 5.0)) < math.log(1.5), (knee, ratio, lines)
    assert ttft_p99(knee / 2, NUM_REQUESTS) / unloaded < 5.0
    assert lines[-1].startswith(f"knee: {knee:g} qps")


def test_a_factor_the_stream_never_reaches_is_an_error_not_a_rate():
    # All 200 requests at once queue ~100x the unloaded TTFT at most.
    with pytest.raises(KneeNotFound, match="never reached 1000x its unloaded value: at most"):
        find_knee_qps(stream_at, NUM_REQUESTS, FLEET, lambda: make_policy("round_robin"), 1000.0)
