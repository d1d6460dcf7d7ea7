"""``kvserve experiment``: compare routing policies on one request stream.

    kvserve experiment --workload shared_prefix --policies round_robin,cache_aware,cost_ttft \\
        --replicas 8 --qps 20,40,80 --sim --out results/ [--seed 0] [--num-requests N] \\
        [--kv-fraction 0.25 | --kv-blocks-per-replica N] [--workload-arg num_groups=32]

``--live`` replays the stream instead on a live cluster of ``--replicas``
simulated replicas on Ray (workers that run no model and answer after the
cost model's time; see ``kvserve.bench.experiment_live``), through the gRPC
front end, one fresh cluster per run; ``--address`` joins a Ray cluster
instead of starting a local one, ``--time-scale X`` slows steps and arrivals
X times (times are reported / X), ``--model`` names the model directory
whose vocabulary and tokenizer the front end uses.

Every policy sees the same requests at each rate.  ``--qps knee`` finds the rate at which the baseline's TTFT p99 is
``--knee-factor`` times its unloaded value.  Replica caches are sized as a
fraction of the stream's prefix working set (the blocks an infinite cache
would reuse) unless ``--kv-blocks-per-replica`` is given.  Session workloads
start in their steady state and mark a warm-up (served, not measured): the
figures cover the measured requests, ``--num-requests`` of them (by
default 250 per replica: with fewer, a big fleet's figures are its cold
starts and sampling noise; see ``default_num_requests``).

Writes to ``--out``: ``requests.csv`` (one row per request and run),
``summary.csv`` and ``summary.md`` (the table printed at the end, with the
infinite-cache hit rate), ``hit_rate_vs_qps.png`` and ``ttft_p99_vs_qps.png``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.bench.experiment_report import (
    REQUEST_CSV_FIELDS,
    SUMMARY_HEADERS,
    RunSummary,
    plot_summaries,
    progress_line,
    summarize,
    summary_rows,
    write_request_rows,
    write_summary_csv,
)
from kvserve.bench.experiment_knee import find_knee_qps
from kvserve.bench.experiment_setup import (
    DEFAULT_KV_FRACTION,
    DEFAULT_NUM_REQUESTS_RANGE,
    REQUESTS_PER_REPLICA,
    ExperimentError,
    StreamSpec,
    check_live_options,
    default_num_requests,
    default_policy_kwargs,
    describe,
    fleet_config,
    live_model,
    parse_policy_args,
    parse_rates,
    qps_label,
    stream_spec,
)
from kvserve.bench.report import format_table
from kvserve.bench.workloads import WorkloadRequest
from kvserve.bench.workloads.cache_reference import infinite_cache_reference
from kvserve.bench.workloads.registry import TRACE_WORKLOAD, WORKLOADS
from kvserve.scheduler.routing.policies import POLICIES, make_policy
from kvserve.scheduler.routing.policy import RoutingPolicy
from kvserve.scheduler.simulation.cost_model import StepCostModel
from kvserve.scheduler.simulation.simulator import FleetConfig, FleetSimulator, SimulationResult

if TYPE_CHECKING:
    from kvserve.bench.experiment_live import LiveResult

@dataclass(frozen=True, slots=True)
class Run:
    """One run: a policy at a rate."""

    qps: float
    policy: str
    policy_kwargs: dict[str, Any]


# -- command line -----------------------------------------------------------------


def add_experiment_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``experiment`` on a ``kvserve`` subcommand parser."""
    parser = subparsers.add_parser(
        "experiment",
        help="compare routing policies on one workload (simulated fleet)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    workloads = sorted([*WORKLOADS, TRACE_WORKLOAD])
    parser.add_argument("--workload", required=True, help=f"one of {', '.join(workloads)}")
    parser.add_argument(
        "--workload-arg", action="append", default=[], metavar="KEY=VALUE",
        help="override a generator parameter, e.g. num_groups=32 (repeatable)",
    )
    parser.add_argument("--trace", type=Path, help="the JSONL trace of the mooncake workload")
    parser.add_argument(
        "--policies", default=",".join(POLICIES),
        help=f"comma-separated policies (default: all of {', '.join(POLICIES)})",
    )
    parser.add_argument(
        "--policy-arg", action="append", default=[], metavar="POLICY.KEY=VALUE",
        help="a policy constructor argument, e.g. cache_aware.cache_threshold=0.5 (repeatable)",
    )
    parser.add_argument("--replicas", type=int, default=8, help="replicas in the fleet (default 8)")
    parser.add_argument(
        "--qps", required=True,
        help="comma-separated request rates, or 'knee' (the baseline's TTFT p99 at --knee-factor x unloaded); "
        "the mooncake workload also takes 'trace' (its own timing)",
    )
    parser.add_argument("--knee-factor", type=float, default=5.0, help="TTFT p99 multiple for --qps knee (default 5)")
    parser.add_argument("--baseline", default="round_robin", help="the policy ratios are taken against")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sim", action="store_true", help="simulate the fleet (the default)")
    mode.add_argument(
        "--live", action="store_true",
        help="replay the stream on a live cluster of simulated replicas (Ray, gRPC), one run at a time",
    )
    parser.add_argument(
        "--address", default=None, metavar="ADDR",
        help="with --live: join this Ray cluster ('auto' or HOST:PORT) instead of starting a local one",
    )
    parser.add_argument(
        "--model", type=Path, default=None, metavar="DIR",
        help="with --live: the model directory the front end serves (vocabulary, tokenizer; "
        "default: the embedded tiny model); the workload's token ids are drawn from its vocabulary",
    )
    parser.add_argument(
        "--time-scale", type=float, default=None, metavar="X",
        help="with --live: steps last X times the cost model's time and requests arrive X times slower "
        "(reported times are divided by X); default 1",
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and the policies (default 0)")
    low, high = DEFAULT_NUM_REQUESTS_RANGE
    parser.add_argument(
        "--num-requests", type=int,
        help=f"requests per run (default {REQUESTS_PER_REPLICA} per replica, at least {low:,} and at most {high:,})",
    )
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 = Poisson")
    kv = parser.add_mutually_exclusive_group()
    kv.add_argument("--kv-blocks-per-replica", type=int, help="KV blocks per replica")
    kv.add_argument(
        "--kv-fraction", type=float,
        help=f"KV blocks per replica as a fraction of the prefix working set (default {DEFAULT_KV_FRACTION})",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="step token budget (default 2048)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="max running requests per replica")
    parser.add_argument("--cost-model", type=Path, help="step cost model JSON (default: StepCostModel.default())")
    parser.add_argument("--jobs", type=int, default=1, help="simulations run in parallel processes (default 1)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.set_defaults(handler=run_experiment)
    return parser


def run_experiment(args: argparse.Namespace) -> int:
    """Run the experiment ``args`` describe; returns the exit status."""
    try:
        return _run(args)
    except ExperimentError as exc:
        print(f"kvserve experiment: error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, ConnectionError) as exc:
        if not args.live:
            raise
        print(f"kvserve experiment: error: the live run failed: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.num_requests is None:
        args.num_requests = default_num_requests(args.replicas)
    check_live_options(args)
    stream = stream_spec(args)
    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    unknown = [name for name in policies if name not in POLICIES]
    if unknown or not policies:
        raise ExperimentError(f"unknown policies {unknown}; choose from {sorted(POLICIES)}")
    if args.replicas < 1 or args.num_requests < 1 or args.jobs < 1:
        raise ExperimentError("--replicas, --num-requests and --jobs must be >= 1")
    cost_model = StepCostModel.load(args.cost_model) if args.cost_model else StepCostModel.default()
    policy_args = parse_policy_args(args.policy_arg, policies)
    model = None
    if args.live:
        model = live_model(args)
        stream = stream.with_vocab_size(model.vocab_size)

    reference_stream = stream.at(None if stream.workload == TRACE_WORKLOAD else 1.0)
    if not reference_stream:
        raise ExperimentError("the workload has no requests")
    reference = infinite_cache_reference(reference_stream, args.block_size)
    fleet = fleet_config(args, reference_stream, reference, cost_model)
    if model is not None:
        # Synthetic tokens come from the model's vocabulary, live and simulated alike.
        fleet = dataclasses.replace(fleet, vocab_size=model.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    describe(args, stream, reference, fleet)

    def kwargs_for(policy: str) -> dict[str, Any]:
        kwargs = default_policy_kwargs(policy, args.seed, fleet)
        kwargs.update(policy_args.get(policy, {}))
        return kwargs

    rates = parse_rates(args.qps, stream)
    if rates == ["knee"]:
        if args.baseline not in POLICIES:
            raise ExperimentError(f"unknown --baseline {args.baseline!r}")
        if stream.workload == TRACE_WORKLOAD:
            raise ExperimentError("--qps knee needs a generated workload, not a trace")
        if not args.knee_factor > 1:
            raise ExperimentError(f"--knee-factor must be > 1, got {args.knee_factor}")
        baseline_kwargs = kwargs_for(args.baseline)

        def stream_at(qps: float, num_requests: int) -> list[WorkloadRequest]:
            return dataclasses.replace(stream, num_requests=num_requests).at(qps)

        rates = [
            find_knee_qps(
                stream_at, stream.num_requests, fleet, lambda: make_policy(args.baseline, **baseline_kwargs),
                args.knee_factor, report=_print_progress,
            )
        ]
    runs = [Run(qps, policy, kwargs_for(policy)) for qps in rates for policy in policies]

    summaries: list[RunSummary] = []
    request_csv = args.out / "requests.csv"
    with open(request_csv, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(REQUEST_CSV_FIELDS)
        infinite_hit_rates: dict[float | None, float] = {}
        measured: dict[float | None, list[bool]] = {}
        if model is not None:
            results = _run_live_all(runs, stream, fleet, model.model_dir, args)
        else:
            results = _simulate_all(runs, stream, fleet, args.jobs)
        for run, result in results:
            if run.qps not in infinite_hit_rates:
                # Per rate: a session workload's stream depends on it.
                requests = stream.at(run.qps)
                infinite_hit_rates[run.qps] = infinite_cache_reference(requests, args.block_size).hit_rate
                measured[run.qps] = [r.measured for r in requests]
            summary = summarize(
                result,
                workload=stream.workload,
                qps=qps_label(run.qps, reference_stream),
                infinite_hit_rate=infinite_hit_rates[run.qps],
                measured=measured[run.qps],
            )
            summaries.append(summary)
            write_request_rows(writer, result, summary.qps, measured[run.qps])

    baseline = args.baseline if args.baseline in policies else policies[0]
    table = format_table(SUMMARY_HEADERS, summary_rows(summaries, baseline))
    infinite = ", ".join(
        f"{rate:.3f} at {qps_label(qps, reference_stream):g} qps" for qps, rate in infinite_hit_rates.items()
    )
    mode = "live, simulated replicas" if args.live else "simulated"
    header = (
        f"{stream.workload} ({mode}): {stream.num_requests} requests, {fleet.num_replicas} replicas x "
        f"{fleet.cache_config.num_usable_blocks} KV blocks of {fleet.cache_config.block_size} tokens; "
        f"infinite-cache hit rate {infinite}; baseline {baseline}"
    )
    print()
    print(header)
    print(table)
    write_summary_csv(args.out / "summary.csv", summaries)
    (args.out / "summary.md").write_text(f"{header}\n\n{table}\n")
    if not args.no_plots:
        for path in plot_summaries(summaries, args.out):
            print(f"wrote {path}")
    print(f"wrote {request_csv}, {args.out / 'summary.csv'}, {args.out / 'summary.md'}")
    return 0


# -- running ------------------------------------------------------------------------


def _print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def simulate(
    stream: Sequence[WorkloadRequest],
    fleet: FleetConfig,
    policy: RoutingPolicy,
    *,
    label: str = "",
    report: Callable[[str], None] | None = None,
) -> SimulationResult:
    """One simulated run, reporting progress every 10% as a line."""
    start = time.perf_counter()
    emit = report or _print_progress

    def progress(num_finished: int, num_requests: int) -> None:
        emit(progress_line(label, num_finished, num_requests, time.perf_counter() - start))

    return FleetSimulator(fleet, policy).run(
        stream, progress=progress, progress_every=max(1, len(stream) // 10)
    )


def _label(run: Run) -> str:
    return f"{run.policy} @ {'trace' if run.qps is None else f'{run.qps:g}'} qps"


def _run_one(run: Run, stream_spec: StreamSpec, fleet: FleetConfig) -> SimulationResult:
    stream = stream_spec.at(run.qps)
    return simulate(stream, fleet, make_policy(run.policy, **run.policy_kwargs), label=_label(run))


def _run_live_all(
    runs: Sequence[Run], stream: StreamSpec, fleet: FleetConfig, model_dir: str, args: argparse.Namespace
) -> list[tuple[Run, LiveResult]]:
    """Each run on a fresh live cluster of simulated replicas, one after the other."""
    # NOTE: imported here: Ray and gRPC are not needed by simulated experiments.
    from kvserve.bench.experiment_live import live_cluster_config, ray_session, run_live

    _print_progress(f"{len(runs)} live runs, {fleet.num_replicas} simulated replicas each")
    results = []
    with ray_session(args.address, num_worker_slots=fleet.num_replicas):
        for run in runs:
            requests = stream.at(run.qps)
            try:
                config = live_cluster_config(
                    fleet, requests, model_dir=model_dir, policy=run.policy, policy_kwargs=run.policy_kwargs,
                    time_scale=args.time_scale or 1.0, placement_timeout_s=None if args.address else 60.0,
                )
            except ValueError as exc:
                raise ExperimentError(f"{run.policy}: {exc}") from None
            results.append((run, run_live(requests, config, label=_label(run), report=_print_progress)))
    return results


def _simulate_all(
    runs: Sequence[Run], stream: StreamSpec, fleet: FleetConfig, jobs: int
) -> list[tuple[Run, SimulationResult]]:
    _print_progress(f"{len(runs)} runs")
    if jobs == 1 or len(runs) == 1:
        return [(run, _run_one(run, stream, fleet)) for run in runs]
    # NOTE: fork, so that children need not re-import; each regenerates its
    # stream from the spec (deterministic) rather than receiving it pickled.
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("fork")) as pool:
        futures = [pool.submit(_run_one, run, stream, fleet) for run in runs]
        return [(run, future.result()) for run, future in zip(runs, futures)]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvserve.bench.experiment ...`` (the same as ``kvserve experiment``)."""
    parser = argparse.ArgumentParser(prog="kvserve")
    add_experiment_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["experiment", *(sys.argv[1:] if argv is None else argv)])
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
