"""Benchmark: the fleet simulator at scale (target: 1,000 replicas x 100k requests < 5 min).

Workload: the shared-prefix stream of the routing experiments (64 groups of
2,048-token system prompts, 128-token questions, 256-token answers by
default), each replica offered ``--qps-per-replica`` requests per second
(default 3.83: the rate at which round robin's TTFT p99 is 5x its unloaded
value on 64 replicas) and holding ``--kv-blocks`` blocks (default 2,048: a
quarter of the stream's prefix working set).

The replicas are stepped by ``--processes`` processes
(``FleetSimulator(processes=...)``, the same results as one).  The default is
two where this process may run on two or more cores, else one; whether those
cores are busy with other work is not checked, and on a loaded machine, or at
small sizes, one process can be the faster.

Baselines, measured in the same run, on a tenth of the requests: one process,
so ``speed-up`` shows what the other processes bring; and the full run's
process count, so ``ratio`` shows whether the cost per request stays flat as
the run grows (1.0 = linear).

Every run simulates a warm-up of 4 requests per group (256) before its
measured requests, in the same simulation (it fills the caches the measured
ones hit), so its time is in every timing: ``ms/request`` divides the total
by every simulated request, warm-up included, and progress counts them all.
The target is judged only at its own scale (1,000 replicas x 100k requests,
the default workload); at any other, the table says it is not judged.

The run is largely bound by memory latency (see ``kvserve.bench.memory_latency``),
so the table ends with this machine's time to read an uncached object: read
a total beside it, not alone.

    python -m kvserve.bench.simulator_scale [--replicas 1000] [--requests 100000] [--policy cost_ttft] [--processes N]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
from dataclasses import dataclass
import sys
import time
from collections.abc import Sequence

from kvserve.bench.arg_types import float_above, int_at_least
from kvserve.bench.memory_latency import object_read_times
from kvserve.experiments.report import format_table
from kvserve.experiments.workloads import WorkloadRequest, make_workload
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.routing.policies import DEFAULT_POLICY, POLICIES, make_policy
from kvserve.scheduler.cores import available_cores
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.simulation.simulator import FleetConfig, FleetSimulator

TARGET_SECONDS = 300.0
# The scale the target is for: replicas, measured requests, and the default workload.
TARGET_SCALE = {"replicas": 1000, "requests": 100_000, "qps_per_replica": 3.83, "kv_blocks": 2048, "output_len": 256}
# Progress lines per run, about.
PROGRESS_LINES = 10
HEADERS = ["requests", "warm-up", "processes", "workload s", "fleet s", "simulate s", "total s", "steps", "steps/s",
           "tokens/s", "ms/request", "virtual s"]


@dataclass(frozen=True, slots=True)
class RunTimes:
    """One run's timings and counts: ``num_measured`` requests after ``num_warmup`` warm-up ones, all simulated."""

    num_measured: int
    num_warmup: int
    processes: int
    workload_s: float
    fleet_s: float
    simulate_s: float
    num_steps: int
    num_tokens: int
    virtual_s: float

    @property
    def total_s(self) -> float:
        return self.workload_s + self.fleet_s + self.simulate_s

    @property
    def ms_per_request(self) -> float:
        """The total over every simulated request: the warm-up's time is in the total, so its requests count."""
        return self.total_s / (self.num_measured + self.num_warmup) * 1e3

    def row(self) -> list[object]:
        return [
            self.num_measured, self.num_warmup, self.processes, f"{self.workload_s:.1f}", f"{self.fleet_s:.1f}",
            f"{self.simulate_s:.1f}", f"{self.total_s:.1f}", self.num_steps, f"{self.num_steps / self.simulate_s:.0f}",
            f"{self.num_tokens / self.simulate_s:.0f}", f"{self.ms_per_request:.2f}", f"{self.virtual_s:.1f}",
        ]


def target_verdict(args: argparse.Namespace, total_s: float) -> str:
    """Whether ``total_s`` meets the target, judged only when ``args`` are the target's scale and workload."""
    if any(getattr(args, name) != value for name, value in TARGET_SCALE.items()):
        return (f"<= {TARGET_SECONDS:.0f}: not judged at this scale (the target is for {TARGET_SCALE['replicas']} "
                f"replicas x {TARGET_SCALE['requests']} requests, default workload)")
    return f"<= {TARGET_SECONDS:.0f}: {'yes' if total_s <= TARGET_SECONDS else 'NO'}"


def default_processes() -> int:
    """Two where this process may run on two or more cores (not checked for load), else one.

    Two is the most this project's machines had to measure the target with.
    """
    return 2 if available_cores() >= 2 else 1


def workload(args: argparse.Namespace, num_requests: int, **params: object) -> list[WorkloadRequest]:
    """The shared-prefix stream of ``num_requests`` measured requests at the flags' rate (``params``: more)."""
    return make_workload(
        "shared_prefix", num_requests, args.qps_per_replica * args.replicas, seed=args.seed,
        output_len=args.output_len, **params,
    )


def fleet_config(args: argparse.Namespace, requests: Sequence[WorkloadRequest]) -> FleetConfig:
    """``--replicas`` replicas of ``--kv-blocks`` usable blocks each, long enough for every request."""
    longest = max(r.num_prompt_tokens + r.output_len for r in requests)
    return FleetConfig(
        num_replicas=args.replicas,
        scheduler_config=SchedulerConfig(max_model_len=longest),
        cache_config=CacheConfig(block_size=16, num_blocks=args.kv_blocks + 1),  # one is the null block
        cost_model=StepCostModel.default(),
    )


def check_fits(args: argparse.Namespace) -> None:
    """Simulate one request on one replica: ``ValueError`` when a replica of ``--kv-blocks`` cannot serve it.

    Every request of the stream is as long (a system prompt, a question, an answer of fixed lengths).
    """
    (request,) = workload(args, 1, warmup_per_group=0)
    fleet = dataclasses.replace(fleet_config(args, [request]), num_replicas=1)
    FleetSimulator(fleet, make_policy("round_robin")).run([request])


def run(args: argparse.Namespace, num_requests: int, processes: int) -> RunTimes:
    # A dropped fleet's blocks form cycles (their free list): free the
    # baseline run's before this one is timed.
    gc.collect()
    start = time.perf_counter()
    requests = workload(args, num_requests)
    generated = time.perf_counter()
    fleet = fleet_config(args, requests)
    kwargs = {"cost_model": fleet.cost_model} if args.policy == "cost_ttft" else {}
    simulator = FleetSimulator(fleet, make_policy(args.policy, **kwargs), processes=processes)
    built = time.perf_counter()
    num_warmup = len(requests) - num_requests

    def progress(num_finished: int, total: int) -> None:
        print(f"  {num_requests} requests after {num_warmup} warm-up, {processes} processes: "
              f"{100 * num_finished // total:3d}% of all simulated ({time.perf_counter() - built:.0f} s)",
              file=sys.stderr, flush=True)

    result = simulator.run(requests, progress=progress, progress_every=max(1, len(requests) // PROGRESS_LINES))
    finished = time.perf_counter()
    return RunTimes(
        num_measured=num_requests, num_warmup=num_warmup, processes=simulator.processes, workload_s=generated - start,
        fleet_s=built - generated, simulate_s=finished - built, num_steps=sum(result.replica_num_steps),
        num_tokens=sum(r.num_output_tokens for r in result.records), virtual_s=result.end_time,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int_at_least(1), default=1000, help="replicas (default 1000)")
    parser.add_argument("--requests", type=int_at_least(1), default=100_000,
                        help="measured requests of the full-size run, after a warm-up of 4 per group (default 100000)")
    parser.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES), metavar="POLICY",
                        help=f"routing policy, one of {', '.join(sorted(POLICIES))} (default {DEFAULT_POLICY})")
    parser.add_argument("--qps-per-replica", type=float_above(0), default=3.83,
                        help="arrival rate per replica (default 3.83)")
    parser.add_argument("--kv-blocks", type=int_at_least(1), default=2048,
                        help="usable KV blocks of 16 tokens per replica (default 2048)")
    parser.add_argument("--output-len", type=int_at_least(1), default=256, help="tokens per answer (default 256)")
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the workload (default 0)")
    parser.add_argument(
        "--processes", type=int_at_least(1), default=default_processes(),
        help="processes that step the replicas (FleetSimulator(processes=...); default here: %(default)s, "
        "which is 2 where this process may run on two or more cores, else 1; their load is not checked, "
        "and on a busy machine or at small sizes 1 can be faster)",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the 1/10-size baseline runs")
    args = parser.parse_args(argv)
    try:
        check_fits(args)
    except ValueError as exc:
        parser.error(f"--kv-blocks {args.kv_blocks}: a replica cannot serve one request: {exc}")
    reads = object_read_times()
    tenth = max(1, args.requests // 10)
    runs = []
    processes = min(args.processes, args.replicas)  # FleetSimulator's: no more processes than replicas
    if not args.no_baseline:
        runs.append(run(args, tenth, 1))
        if processes > 1:
            runs.append(run(args, tenth, processes))
    runs.append(run(args, args.requests, processes))
    print(f"{args.replicas} replicas, policy {args.policy}, {args.qps_per_replica * args.replicas:g} qps, "
          f"{args.kv_blocks} KV blocks per replica, {args.output_len}-token answers; "
          "ms/request: total s over every simulated request, warm-up included")
    print(format_table(HEADERS, [r.row() for r in runs]))
    total = runs[-1].total_s
    lines = [["total seconds", f"{total:.1f}", target_verdict(args, total)]]
    if len(runs) > 1:
        ratio = runs[-1].ms_per_request / runs[-2].ms_per_request
        lines.append(["ms/request vs 1/10-size run", f"{ratio:.2f}", "1.0 = linear in requests"])
    if len(runs) == 3:
        speedup = runs[0].total_s / runs[1].total_s
        lines.append([
            f"speed-up of {processes} processes", f"{speedup:.2f}",
            "1/10-size run: 1 process's total / theirs",
        ])
    lines.append([
        "ns per random object read", f"{reads.random_ns:.0f}",
        f"this machine's memory latency (in order: {reads.sequential_ns:.0f} ns)",
    ])
    print()
    print(format_table(["figure", "value", "meaning"], lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
