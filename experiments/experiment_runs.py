"""The runs of ``kvserve experiment``: each policy at each rate, simulated (in parallel jobs) or live."""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.cluster.interrupts import ignore_stop_signals, stop_signals_ignored
from kvserve.experiments.experiment_fleet import fleet_for
from kvserve.experiments.experiment_report import progress_line
from kvserve.experiments.experiment_setup import ExperimentError, StreamSpec
from kvserve.experiments.report import count
from kvserve.experiments.workloads import WorkloadRequest
from kvserve.scheduler.routing.policies import make_policy
from kvserve.scheduler.routing.policy import RoutingPolicy
from kvserve.scheduler.simulation.simulator import FleetConfig, FleetSimulator, SimulationResult

if TYPE_CHECKING:
    from kvserve.experiments.experiment_live import LiveResult


@dataclass(frozen=True, slots=True)
class Run:
    """One run: a policy at a rate."""

    qps: float
    policy: str
    policy_kwargs: dict[str, Any]


# A stage's line, and a run's progress lines, are printed only once it has taken this long:
# a quick experiment prints its setup and its table, not a dozen lines a run.
QUIET_SECONDS = 2.0


def print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextmanager
def stage(line: str) -> Iterator[None]:
    """Say ``line`` (on stderr) once the stage under way has taken ``QUIET_SECONDS``; never if it ends sooner."""
    if QUIET_SECONDS <= 0:
        print_progress(line)
        yield
        return
    timer = threading.Timer(QUIET_SECONDS, print_progress, (line,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def simulate(
    stream: Sequence[WorkloadRequest],
    fleet: FleetConfig,
    policy: RoutingPolicy,
    *,
    label: str = "",
    report: Callable[[str], None] | None = None,
    processes: int = 1,
) -> SimulationResult:
    """One simulated run (its replicas stepped by ``processes`` processes), reporting progress every 10% as a
    line once it has run ``QUIET_SECONDS``."""
    start = time.perf_counter()
    emit = report or print_progress

    def progress(num_finished: int, num_requests: int) -> None:
        elapsed = time.perf_counter() - start
        if elapsed >= QUIET_SECONDS:
            emit(progress_line(label, num_finished, num_requests, elapsed))

    return FleetSimulator(fleet, policy, processes=processes).run(
        stream, progress=progress, progress_every=max(1, len(stream) // 10)
    )


def run_label(run: Run) -> str:
    return f"{run.policy} @ {'trace' if run.qps is None else f'{run.qps:g}'} qps"


def run_one(run: Run, stream_spec: StreamSpec, fleet: FleetConfig, processes: int) -> SimulationResult:
    stream = stream_spec.at(run.qps)
    policy = make_policy(run.policy, **run.policy_kwargs)
    try:
        return simulate(stream, fleet_for(fleet, stream), policy, label=run_label(run), processes=processes)
    except ValueError as exc:  # e.g. times beyond the virtual clock's precision
        raise ExperimentError(f"{run_label(run)}: {exc}") from None


def run_live_all(
    runs: Sequence[Run], stream: StreamSpec, fleet: FleetConfig, model_dir: str, args: argparse.Namespace
) -> list[tuple[Run, LiveResult]]:
    """Each run on a fresh live cluster of simulated replicas, one after the other."""
    # NOTE: imported here: Ray and gRPC are not needed by simulated experiments.
    from kvserve.experiments.experiment_live import live_cluster_config, ray_session, run_live

    print_progress(f"{count(len(runs), 'live run')}, {count(fleet.num_replicas, 'simulated replica')} each")
    results = []
    with ray_session(args.address, num_worker_slots=fleet.num_replicas, report=print_progress):
        for run in runs:
            requests = stream.at(run.qps)
            try:
                config = live_cluster_config(
                    fleet_for(fleet, requests), requests, model_dir=model_dir, policy=run.policy, policy_kwargs=run.policy_kwargs,
                    time_scale=args.time_scale, placement_timeout_s=None if args.address else 60.0,
                )
            except ValueError as exc:
                raise ExperimentError(f"{run.policy}: {exc}") from None
            results.append((run, run_live(requests, config, label=run_label(run), report=print_progress)))
    return results


def simulate_all(
    runs: Sequence[Run], stream: StreamSpec, fleet: FleetConfig, jobs: int, processes: int
) -> list[tuple[Run, SimulationResult]]:
    print_progress(count(len(runs), "run"))
    if jobs == 1 or len(runs) == 1:
        return [(run, run_one(run, stream, fleet, processes)) for run in runs]
    # NOTE: fork, so that children need not re-import; each regenerates its
    # stream from the spec (deterministic) rather than receiving it pickled.
    # Workers ignore Ctrl-C and SIGTERM (a terminal or a process manager may
    # send them to the whole group): the parent alone handles them, and stops them.
    other_children = set(multiprocessing.active_children())
    jobs = min(jobs, len(runs))
    pool = ProcessPoolExecutor(
        max_workers=jobs, mp_context=multiprocessing.get_context("fork"), initializer=ignore_stop_signals
    )
    try:
        futures = [pool.submit(run_one, run, stream, fleet, processes) for run in runs]
        results = [(run, future.result()) for run, future in zip(runs, futures)]
    except BaseException as exc:
        # Stop the runs under way (else shutting down waits for them), and
        # let no second Ctrl-C or SIGTERM cut that short: it would leave workers behind.
        with stop_signals_ignored():
            for worker in set(multiprocessing.active_children()) - other_children:
                worker.kill()
                worker.join()
            pool.shutdown(cancel_futures=True)
        if isinstance(exc, BrokenProcessPool):
            # Killed from outside: on Linux, most often by the kernel when memory ran out.
            raise ExperimentError(
                f"a simulation worker died (killed, most likely for memory: {jobs} fleets of "
                f"{fleet.num_replicas:,} replicas x {fleet.cache_config.num_blocks:,} KV blocks at once); "
                "fewer --jobs or a smaller fleet needs less"
            ) from None
        raise
    pool.shutdown()
    return results
