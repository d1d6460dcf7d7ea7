"""The fleet simulator with its replicas stepped by several processes: the same results as one process."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import astuple
from pathlib import Path

import pytest

from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.routing.policies import make_policy
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.simulation.replica_shard import ShardFailedError
from kvserve.scheduler.simulation.simulator import FleetConfig, FleetSimulator, SimulationResult
from tests.scheduler.simulation.test_simulator import Item

MODEL = StepCostModel(a=0.01, b=1e-4, c=1e-3, d=2e-7)
BLOCK_SIZE = 16


def config(num_replicas: int, num_blocks: int = 64) -> FleetConfig:
    return FleetConfig(
        num_replicas=num_replicas,
        scheduler_config=SchedulerConfig(max_num_batched_tokens=256, max_model_len=2048),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        cost_model=MODEL,
    )


def stream(num_requests: int) -> list[Item]:
    """Shared prefixes of two tenants, some with scripted answers, arriving in bursts
    (several in one step), on pools small enough to evict and preempt."""
    items = []
    for i in range(num_requests):
        group = (i * 7) % 6
        prefix = [3 + group] * (96 + 16 * group)
        question = [100 + i % 50] * (5 + i % 23)
        output_len = 4 + i % 17
        answer = [200 + (i + k) % 300 for k in range(output_len + i % 5)] if i % 3 == 0 else None
        items.append(Item(0.004 * i - 0.004 * (i % 4), prefix + question, output_len, f"tenant-{i % 2}", answer))
    return sorted(items, key=lambda item: item.arrival_time)


def simulate(policy: str, processes: int, items: Sequence[Item], fleet: FleetConfig) -> SimulationResult:
    kwargs = {"cost_model": MODEL} if policy == "cost_ttft" else {}
    return FleetSimulator(fleet, make_policy(policy, **kwargs), processes=processes).run(items)


@pytest.fixture(autouse=True)
def no_process_left_behind():
    yield
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "consistent_hash", "cache_aware", "cost_ttft"])
def test_two_processes_give_the_one_process_result_record_for_record(policy: str) -> None:
    items = stream(400)
    alone = simulate(policy, 1, items, config(5))
    shared = simulate(policy, 2, items, config(5))

    assert shared == alone  # every record, every replica's totals (wall time excluded)
    assert sum(r.num_cached_tokens for r in alone.records) > 0
    assert sum(r.num_preemptions for r in alone.records) > 0  # the pools were under pressure


def test_three_processes_on_a_fleet_of_cache_aware_replicas_agree_too() -> None:
    items = stream(300)

    assert simulate("cache_aware", 3, items, config(7)) == simulate("cache_aware", 1, items, config(7))


def test_more_processes_than_replicas_use_one_per_replica() -> None:
    fleet = config(2)
    simulator = FleetSimulator(fleet, make_policy("round_robin"), processes=8)

    assert simulator.processes == 2
    assert simulator.run(stream(40)) == simulate("round_robin", 1, stream(40), fleet)


@pytest.mark.parametrize("processes", [0, -1, True, 1.5, "2"])
def test_a_process_count_that_is_not_a_positive_integer_is_refused(processes: object) -> None:
    with pytest.raises(ValueError, match="processes must be a positive integer"):
        FleetSimulator(config(2), make_policy("round_robin"), processes=processes)  # type: ignore[arg-type]


def test_a_request_a_shard_process_cannot_serve_is_reported_as_the_one_process_run_reports_it() -> None:
    fleet = config(2, num_blocks=8)
    # Round robin sends request 1 to replica 1: the shard process's.
    items = [Item(0.0, [5] * 16, 2), Item(0.1, [6] * 200, 2)]
    with pytest.raises(ValueError, match="request 1 cannot be served") as alone:
        simulate("round_robin", 1, items, fleet)
    with pytest.raises(ValueError, match="request 1 cannot be served") as shared:
        simulate("round_robin", 2, items, fleet)

    assert str(shared.value) == str(alone.value)


def test_an_error_in_the_main_process_stops_the_shard_processes() -> None:
    items = stream(30) + [Item(0.0, [5] * 20, 2)]  # arrives before the ones ahead of it
    with pytest.raises(ValueError, match="sorted by arrival time"):
        simulate("cache_aware", 2, items, config(4))
    # no_process_left_behind checks the shard is gone.


def test_ctrl_c_during_a_run_stops_the_shard_processes() -> None:
    def interrupt(num_finished: int, num_requests: int) -> None:
        raise KeyboardInterrupt

    simulator = FleetSimulator(config(4), make_policy("cache_aware"), processes=2)
    with pytest.raises(KeyboardInterrupt):
        simulator.run(stream(200), progress=interrupt, progress_every=50)
    # no_process_left_behind checks the shard is gone.


def test_a_platform_without_fork_cannot_have_several_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])

    with pytest.raises(ValueError, match="processes > 1 needs the fork start method"):
        FleetSimulator(config(2), make_policy("round_robin"), processes=2)
    assert FleetSimulator(config(2), make_policy("round_robin"), processes=1).processes == 1


def test_a_shard_process_that_dies_fails_the_run_with_an_error_naming_it() -> None:
    def kill_the_shards(num_finished: int, num_requests: int) -> None:
        for child in multiprocessing.active_children():
            child.kill()

    simulator = FleetSimulator(config(4), make_policy("round_robin"), processes=2)
    with pytest.raises(ShardFailedError, match=r"the simulation process of replicas 1\.\.3 died \(exit code -9\)"):
        simulator.run(stream(200), progress=kill_the_shards, progress_every=20)


_KILLED_MAIN = """
import multiprocessing, sys, time
sys.path.insert(0, {root!r})
from tests.scheduler.simulation.test_sharded_simulator import Item, config
from kvserve.scheduler.routing.policies import make_policy
from kvserve.scheduler.simulation.simulator import FleetSimulator

def progress(done, total):
    print(*(child.pid for child in multiprocessing.active_children()), flush=True)
    time.sleep(60)  # the test kills this process meanwhile

items = [Item(0.001 * i, [5 + i % 7] * 40, 30) for i in range(2000)]
FleetSimulator(config(4), make_policy("round_robin"), processes=2).run(items, progress=progress, progress_every=10)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_a_shard_process_dies_with_its_main_process(tmp_path: Path) -> None:
    script = tmp_path / "main.py"
    script.write_text(_KILLED_MAIN.format(root=str(Path(__file__).parents[3])))
    main = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        shard_pid = int(main.stdout.readline())  # type: ignore[union-attr]
        main.kill()  # as the kernel's OOM killer would: no clean-up runs
        main.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(shard_pid):
            time.sleep(0.05)
        assert not _alive(shard_pid)
    finally:
        main.kill()
        main.stdout.close()  # type: ignore[union-attr]


def _alive(pid: int) -> bool:
    # The orphaned shard is reaped by init, or is a zombie until then: either way, not running.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timing
@pytest.mark.parametrize("all_at_once", [False, True])
def test_progress_counts_every_process_s_finished_requests_up_to_all_of_them(all_at_once: bool) -> None:
    # All at once: nothing finishes before the last arrival, so every count comes from the drain.
    items = [Item(0.0, *fields[1:]) for fields in map(astuple, stream(200))] if all_at_once else stream(200)
    seen: list[tuple[int, int]] = []
    FleetSimulator(config(4, num_blocks=256), make_policy("round_robin"), processes=2).run(
        items, progress=lambda done, total: seen.append((done, total)), progress_every=20
    )

    done = [d for d, _ in seen]
    assert done == sorted(done) and len(set(done)) == len(done)
    assert {total for _, total in seen} == {200}
    assert seen[-1] == (200, 200)
    # Along the way, from both processes: a shard sends a count every 20 of its own finished requests,
    # but the counts that pile up while this process steps are read together (a report gained 84
    # requests in one CI run: more than one count; 40 at most in 15 runs on an idle machine).  The
    # bound is what a shard sending no counts in its drain breaks, and a busy machine does not
    # unless it holds this process up for the shard's whole drain: the shard's 100 requests (all of
    # them finish in the drain when all arrive at once) came in one jump at the end.
    assert max(b - a for a, b in zip([0, *done], done)) < 100
