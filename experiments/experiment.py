"""``kvserve experiment``: compare routing policies on one request stream.

    kvserve experiment --workload shared_prefix --policies round_robin,cache_aware,cost_ttft \\
        --replicas 8 --qps 20,40,80 --sim --out results/ [--seed 0 | --seeds 0,1,2] [--num-requests N] \\
        [--kv-fraction 0.25 | --kv-blocks-per-replica N] [--workload-arg num_groups=32]

``--live`` replays the stream instead on a live cluster of ``--replicas``
simulated replicas on Ray (workers that run no model and answer after the
cost model's time; see ``kvserve.experiments.experiment_live``), through the gRPC
front end, one fresh cluster per run; ``--address`` joins a Ray cluster
instead of starting a local one, ``--time-scale X`` (default 5) slows steps
and arrivals X times (times are reported / X), ``--model`` names the model directory
whose vocabulary and tokenizer the front end uses.

Every policy sees the same requests at each rate.  ``--qps knee`` finds the rate at which the baseline's TTFT p99 is
``--knee-factor`` times its unloaded value, by simulation (with ``--live``
too: the live runs follow at that rate).  Replica caches are sized as a
fraction of the prefix working set (the blocks an infinite cache would
reuse) of the stream at 1 qps with the default number of requests (a trace:
all its records), whatever ``--num-requests`` and the rates, unless
``--kv-blocks-per-replica`` is given: the hardware stays the same however
long a run measures and whatever load it is under.  Every workload marks
a warm-up (served, not measured: a session workload's sessions under way
at the start, a prefix workload's first requests per group, a trace's
first tenth): the figures, load per replica included, cover the measured
requests, ``--num-requests`` of them (by default 250 per replica: with
fewer, a big fleet's figures are sampling noise; see
``default_num_requests``; a trace: its earliest records, warm-up included).

Writes to ``--out``: ``config.json`` (the settings, defaults applied as values: the cost model's
coefficients, the model directory served, every workload parameter; with ``--qps knee``, the
rate found is added to it) at the start; once every run has finished, ``requests.csv`` (one row
per request and run), ``summary.csv`` (their columns and units: at the end of --help),
``hit_rate_vs_qps.png`` and ``ttft_p99_vs_qps.png``, then ``summary.md`` (the setup printed at
the start and the table printed at the end, with the infinite-cache hit rate) last.  The result
files of an earlier run in ``--out`` (its seeds' folders included) are removed at the start, once
the settings have passed their checks (a refused command leaves them), and each file is written under a
temporary name and renamed when complete: a folder without ``summary.md`` holds no finished run.
With ``--seeds``, each seed's run writes these to ``--out``/seed-N/, then ``aggregate.csv`` and ``aggregate.md``
(each figure's mean, min and max over the seeds: see the end of --help) go to ``--out``, and its table is printed.
Progress goes to stderr: a stage's line once it has taken 2 s, a run's every 10% after its first 2 s.
Ctrl-C or SIGTERM stops the experiment (exit status 130).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvserve.cluster.cli_values import add_cost_model_flag
from kvserve.experiments.experiment_notes import one_replica_note, small_sample_note, trace_shortfall_note
from kvserve.experiments.experiment_report import (
    CSV_COLUMNS_HELP,
    PLOTS,
    REQUEST_CSV_FIELDS,
    SUMMARY_HEADERS,
    RunSummary,
    atomic_open,
    plot_summaries,
    replayed_counts,
    summarize,
    summary_rows,
    write_request_rows,
    write_summary_csv,
)
from kvserve.experiments.experiment_fleet import (
    available_memory_bytes,
    cache_sized_by,
    check_fleet_memory,
    fleet_at_rate,
    fleet_config,
    rate_phrase,
    sizing_stream,
    stream_at_rate,
)
from kvserve.experiments import experiment_runs
from kvserve.experiments.experiment_knee import KneeNotFound, find_knee_qps
from kvserve.experiments.experiment_seeds import AGGREGATE_CSV_HELP, AGGREGATE_FILES, ExperimentOutcome, run_each_seed
from kvserve.experiments.experiment_runs import Run, print_progress, stage
from kvserve.experiments.experiment_output import check_output_dir, prepare_output, record_in_config
from kvserve.experiments.experiment_setup import (
    DEFAULT_BASELINE,
    DEFAULT_BURSTINESS,
    DEFAULT_KNEE_FACTOR,
    DEFAULT_TIME_SCALE,
    DEFAULT_KV_FRACTION,
    DEFAULT_NUM_REQUESTS_RANGE,
    REQUESTS_PER_REPLICA,
    ExperimentError,
    StreamSpec,
    check_live_options,
    check_options,
    check_policies,
    choose_baseline,
    cost_model_name,
    default_num_requests,
    default_policy_kwargs,
    describe,
    live_model,
    load_cost_model,
    parse_policies,
    parse_policy_args,
    parse_rates,
    qps_label,
    stream_spec,
)
from kvserve.experiments.report import count, format_table
from kvserve.experiments.workloads import WorkloadRequest
from kvserve.experiments.workloads.cache_reference import infinite_cache_reference
from kvserve.experiments.workloads.registry import TRACE_WORKLOAD, WORKLOADS
from kvserve.cluster.interrupts import closed_stdout_status, sigterm_as_interrupt
from kvserve.scheduler.routing.policies import POLICIES, make_policy

# What a run writes besides config.json; an earlier run's are removed at the start.
# summary.md first: a folder without it holds no finished run, even if removing a later one fails.
RESULT_FILES = (
    "summary.md", *AGGREGATE_FILES, "requests.csv", "summary.csv", *(filename for _, _, filename in PLOTS)
)


# -- command line -----------------------------------------------------------------


# What --help says does not combine (each is refused with an error naming it).
_DO_NOT_COMBINE = """\
options that do not combine:
  --qps knee            not with the mooncake workload (a trace; give rates or 'trace')
  --qps trace           only with the mooncake workload
  --knee-factor         only with --qps knee
  --trace               only with (and required by) --workload mooncake
  --burstiness          not with a trace: its arrivals keep the trace's pattern
  --address, --model, --time-scale    only with --live
  --jobs, --sim-processes             only for simulations (not --live)
  --seeds               not with --seed, nor with --qps knee (each seed would find a knee of its own)
  --sim / --live, --kv-blocks-per-replica / --kv-fraction: one of each pair
"""


def add_experiment_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``experiment`` on a ``kvserve`` subcommand parser."""
    parser = subparsers.add_parser(
        "experiment",
        help="compare routing policies on one workload (simulated fleet, or --live on Ray)",
        description=__doc__,
        epilog=f"{_DO_NOT_COMBINE}\n{CSV_COLUMNS_HELP}{AGGREGATE_CSV_HELP}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    workloads = sorted([*WORKLOADS, TRACE_WORKLOAD])
    parser.add_argument("--workload", required=True, help=f"one of {', '.join(workloads)}")
    parser.add_argument(
        "--workload-arg", action="append", default=[], metavar="KEY=VALUE",
        help="override a generator parameter, e.g. num_groups=32 (repeatable; an unknown KEY lists the "
        "workload's parameters and their defaults)",
    )
    parser.add_argument("--trace", type=Path, help="the JSONL trace of the mooncake workload")
    parser.add_argument(
        "--policies", default=",".join(POLICIES),
        help=f"comma-separated policies (default: all of {', '.join(POLICIES)}); your own as MODULE:CLASS, "
        "importable where the replicas' scheduler runs (scheduler/routing/README.md)",
    )
    parser.add_argument(
        "--policy-arg", action="append", default=[], metavar="POLICY.KEY=VALUE",
        help="a policy constructor argument, e.g. cache_aware.cache_threshold=0.5 (repeatable)",
    )
    parser.add_argument("--replicas", type=int, default=8, help="replicas in the fleet (default 8)")
    parser.add_argument(
        "--qps", required=True,
        help="comma-separated request rates, or 'knee' (the baseline's TTFT p99 at --knee-factor x unloaded, "
        "found by simulation, with --live too); "
        "the mooncake workload also takes 'trace' (its own timing)",
    )
    parser.add_argument(
        "--knee-factor", type=float, help=f"TTFT p99 multiple for --qps knee (default {DEFAULT_KNEE_FACTOR:g})"
    )
    parser.add_argument(
        "--baseline",
        help=f"the policy ratios are taken against, one of --policies (default {DEFAULT_BASELINE} if run, "
        f"else the first); with --qps knee, the policy whose knee is found (default {DEFAULT_BASELINE}), "
        "which runs at the knee too",
    )
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
        f"(reported times are divided by X; default {DEFAULT_TIME_SCALE:g}: Ray's and gRPC's few milliseconds "
        "per request and per step then weigh little; the time between two back-to-back steps comes off the "
        "second's. On a 2-core machine, multi-turn chat at 4 replicas and 4 qps, TTFT p50 came out 33%% above "
        "the simulator's with X=1 and 6%% with X=5; at 32 replicas, where their processes keep 2 cores busy, "
        "shared prefixes at 20 qps came out 2.3x the simulator's with X=5 and 1.1x with X=20: raise X with the "
        "replicas per core)",
    )
    parser.add_argument("--out", type=_output_dir, required=True, help="output directory")
    parser.add_argument("--seed", type=int, help="seed of the workload and the policies (default 0)")
    parser.add_argument(
        "--seeds", metavar="S1,S2,...",
        help="instead of --seed: two or more seeds, e.g. 0,1,2; runs the whole experiment once per seed (each into "
        "--out/seed-N/), then prints and writes each figure's mean (min-max) over the seeds per policy and rate, "
        "the TTFT p99 ratio to the baseline taken per seed (aggregate.csv, aggregate.md)",
    )
    low, high = DEFAULT_NUM_REQUESTS_RANGE
    parser.add_argument(
        "--num-requests", type=int,
        help=f"requests per run (default {REQUESTS_PER_REPLICA} per replica, at least {low:,} and at most {high:,}; "
        "a trace: all its records, else its earliest N)",
    )
    parser.add_argument(
        "--burstiness", type=float,
        help=f"gamma shape of arrivals (default {DEFAULT_BURSTINESS:g} = Poisson); not for a trace, whose arrivals keep "
             "their pattern",
    )
    kv = parser.add_mutually_exclusive_group()
    kv.add_argument("--kv-blocks-per-replica", type=int, help="KV blocks per replica")
    kv.add_argument(
        "--kv-fraction", type=float,
        help=f"KV blocks per replica as a fraction of the prefix working set of the stream at 1 qps with the "
             f"default number of requests (default {DEFAULT_KV_FRACTION})",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="step token budget (default 2048)")
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="max running requests per replica (default 256)"
    )
    add_cost_model_flag(parser, "")
    parser.add_argument("--jobs", type=int, default=1, help="simulations run in parallel processes (default 1)")
    parser.add_argument(
        "--sim-processes", type=int, default=1,
        help="processes that step each simulation's replicas (default 1): the same results, sooner for a "
             "large fleet on free cores (1,000 replicas: about 1.5x with 2); --jobs J runs J x this many",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.set_defaults(handler=run_experiment)
    return parser


def run_experiment(args: argparse.Namespace) -> int:
    """Run the experiment ``args`` describe; returns the exit status.

    SIGTERM stops it as Ctrl-C does, until it returns.
    """
    with sigterm_as_interrupt():
        return _run_reporting_errors(args)


def _output_dir(text: str) -> Path:
    """``--out``: an empty name would silently mean the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must name a directory, got an empty string")
    return Path(text)


def _run_reporting_errors(args: argparse.Namespace) -> int:
    try:
        status = run_each_seed(args, _run, RESULT_FILES)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        # The result files are written before the table is printed, so only the printing is cut short.
        return closed_stdout_status()
    except ExperimentError as exc:
        print(f"kvserve experiment: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvserve experiment: interrupted", file=sys.stderr)
        return 130
    except MemoryError as exc:
        print(
            f"kvserve experiment: error: out of memory ({exc or 'no details'}): a shorter stream "
            "(--num-requests) or a smaller fleet needs less",
            file=sys.stderr,
        )
        return 1
    except (RuntimeError, ConnectionError) as exc:
        if not args.live:
            raise
        print(f"kvserve experiment: error: the live run failed: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, before_writing: Callable[[], None]) -> ExperimentOutcome:
    """One experiment (one seed); ``before_writing`` is called once its settings have passed their checks and
    its stream and fleet are made, before anything is written."""
    if args.num_requests is None and args.workload != TRACE_WORKLOAD:  # a trace: all of it
        args.num_requests = default_num_requests(args.replicas)
    check_live_options(args)
    check_options(args)
    stream: StreamSpec = stream_spec(args)
    policies = parse_policies(args.policies)
    rates = parse_rates(args.qps, stream)
    knee = rates == ["knee"]
    args.baseline = choose_baseline(args.baseline, policies, knee)
    if knee:
        if stream.workload == TRACE_WORKLOAD:
            raise ExperimentError("--qps knee needs a generated workload, not a trace")
        if args.knee_factor is None:
            args.knee_factor = DEFAULT_KNEE_FACTOR
        if not (args.knee_factor > 1 and math.isfinite(args.knee_factor)):
            raise ExperimentError(f"--knee-factor must be a number > 1, got {args.knee_factor}")
        # The knee is the baseline's: it runs at the knee too, with a row of its own.
        policies = list(dict.fromkeys([*policies, args.baseline]))
    elif args.knee_factor is not None:
        raise ExperimentError("--knee-factor is for --qps knee")
    policy_args = parse_policy_args(args.policy_arg, policies)
    cost_model = load_cost_model(args)
    policy_kwargs = {
        policy: {
            **default_policy_kwargs(policy, args.seed, cost_model, args.max_num_batched_tokens),
            **policy_args.get(policy, {}),
        }
        for policy in policies
    }
    # The cheap checks come before the stream is generated (a minute or more for a long one).
    check_policies(policy_kwargs, policy_args)
    check_output_dir(args.out)
    model = None
    if args.live:
        model = live_model(args)
        stream = stream.with_vocab_size(model.vocab_size)

    reference_qps = None if stream.workload == TRACE_WORKLOAD else 1.0
    with stage(f"generating the {stream.workload} stream {rate_phrase(reference_qps)}"):
        reference_stream = stream_at_rate(stream, reference_qps)
        if not reference_stream:
            raise ExperimentError("the workload has no requests")
        # A trace may hold fewer than --num-requests; session workloads add a warm-up.
        num_measured = sum(r.measured for r in reference_stream)
        if not num_measured:
            raise ExperimentError(
                f"every one of the workload's {count(len(reference_stream), 'request')} is a warm-up: none "
                "would be measured (more --num-requests, or a shorter warm-up through --workload-arg)"
            )
        reference = infinite_cache_reference(reference_stream, args.block_size)
    # The caches are sized on the default stream's working set, whatever --num-requests (see sizing_stream).
    sizing = sizing_stream(args, stream)
    sizing_reference = reference
    if sizing is not None and (sizing.num_requests, sizing.params) != (stream.num_requests, stream.params):
        num_sizing = "all its" if sizing.num_requests is None else f"{sizing.num_requests:,}"
        rate = rate_phrase(reference_qps)
        with stage(f"generating the stream {rate} with {num_sizing} requests, to size the caches"):
            try:
                sizing_requests = stream_at_rate(sizing, reference_qps)
            except ExperimentError as exc:
                raise ExperimentError(
                    f"sizing the caches on the stream with {num_sizing} requests: {exc}; "
                    "give --kv-blocks-per-replica to set their size instead"
                ) from None
            sizing_reference = infinite_cache_reference(sizing_requests, args.block_size)
    fleet = fleet_config(args, reference_stream, sizing_reference, cost_model)
    if args.address is None:  # a joined cluster's replicas live on its nodes
        num_runs = len(rates) * len(policies)  # the knee's search: one run at a time
        check_fleet_memory(fleet, min(args.jobs, num_runs), available_memory_bytes())
    if model is not None:
        # Synthetic tokens come from the model's vocabulary, live and simulated alike.
        fleet = dataclasses.replace(fleet, vocab_size=model.vocab_size)
    before_writing()
    prepare_output(args, RESULT_FILES, stream, reference, sizing_reference, fleet,
                   None if model is None else model.model_dir)
    setup = describe(stream, num_measured, reference, sizing, sizing_reference, fleet, cost_model_name(args))
    if model is not None:
        setup.append(
            f"token ids come from the served model's vocabulary of {model.vocab_size}: for the same stream "
            f"in simulation, add --workload-arg vocab_size={model.vocab_size}; time scale {args.time_scale:g}"
        )
    notes = (
        trace_shortfall_note(args.num_requests if stream.workload == TRACE_WORKLOAD else None,
                             len(reference_stream), num_measured),
        small_sample_note(num_measured),
        one_replica_note(fleet.num_replicas, len(policies)),
    )
    setup += [note for note in notes if note is not None]
    status = 0
    try:
        for line in setup:
            print(line)
    except BrokenPipeError:  # the reader has gone (`| head -1`): the runs go on and write their files
        status = closed_stdout_status()

    if knee:
        def stream_at(qps: float, num_requests: int) -> list[WorkloadRequest]:
            try:
                return stream_at_rate(dataclasses.replace(stream, num_requests=num_requests), qps)
            except ExperimentError as exc:
                # A session workload's steady state grows with the rate the search tries.
                raise ExperimentError(f"--qps knee: {exc}") from None

        baseline_kwargs = policy_kwargs[args.baseline]
        if model is not None:
            print_progress("knee: searched for in simulation (the same stream and fleet); the live runs follow at it")
        try:
            knee_qps = find_knee_qps(
                stream_at, stream.num_requests, fleet, lambda: make_policy(args.baseline, **baseline_kwargs),
                args.knee_factor, report=print_progress, processes=args.sim_processes,
            )
        except ExperimentError:
            raise
        except (KneeNotFound, ValueError) as exc:  # a ValueError: from the simulator (see simulate)
            raise ExperimentError(f"--qps knee: {exc}") from None
        rates = [knee_qps]
        record_in_config(args.out, knee_qps=knee_qps)
    # Every rate's stream must fit the fleet before any run starts (a session workload's grows with the rate).
    sized_by = cache_sized_by(args, sizing_reference)
    for qps in rates:
        fleet_at_rate(fleet, stream, qps, sized_by)
    runs = [Run(qps, policy, policy_kwargs[policy]) for qps in rates for policy in policies]
    if model is not None:
        results = experiment_runs.run_live_all(runs, stream, fleet, model.model_dir, args)
    else:
        results = experiment_runs.simulate_all(runs, stream, fleet, args.jobs, args.sim_processes)

    # Every run has finished: the results are written, summary.md last (see the module docstring).
    summaries: list[RunSummary] = []
    infinite_hit_rates: dict[float | None, float] = {reference_qps: reference.hit_rate}
    measured: dict[float | None, list[bool]] = {reference_qps: [r.measured for r in reference_stream]}
    request_csv = args.out / "requests.csv"
    with atomic_open(request_csv) as out:
        writer = csv.writer(out)
        writer.writerow(REQUEST_CSV_FIELDS)
        for run, result in results:
            # NOTE: a row is named as --policies names its policy (module:Class for one's own), simulated or live
            # alike; a simulation's result carries the policy's name attribute, which --baseline does not match.
            result = dataclasses.replace(result, policy=run.policy)
            if run.qps not in infinite_hit_rates:
                # Per rate: a session workload's stream depends on it.
                with stage(f"computing the infinite-cache hit rate {rate_phrase(run.qps)}"):
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
    # The streams that ran: a session workload's is longer at a higher rate than at the reference rate.
    replayed = replayed_counts({s.qps: measured[run.qps] for s, (run, _) in zip(summaries, results)})
    header = (
        f"{stream.workload} ({mode}): {replayed}, {count(fleet.num_replicas, 'replica')} x "
        f"{fleet.cache_config.num_usable_blocks} KV blocks of {fleet.cache_config.block_size} tokens; "
        f"infinite-cache hit rate {infinite}; baseline {baseline}"
    )
    write_summary_csv(args.out / "summary.csv", summaries)
    plots = [] if args.no_plots else plot_summaries(summaries, args.out)
    with atomic_open(args.out / "summary.md") as out:
        # The setup as printed at the start (fleet, cost model, seed, notes), then the results.
        setup_lines = "".join(f"{line}  \n" for line in setup)  # Markdown line breaks
        out.write(f"{setup_lines}\n{header}\n\n{table}\n")
    # Printed once every file is written: a reader of stdout that stops early loses nothing.
    try:
        print()
        print(header)
        print(table)
        for path in plots:
            print(f"wrote {path}")
        print(f"wrote {request_csv}, {args.out / 'summary.csv'}, {args.out / 'summary.md'}")
    except BrokenPipeError:  # the reader has gone: with --seeds, the next seeds run and write their files
        status = closed_stdout_status()
    return ExperimentOutcome(status, summaries, baseline)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvserve.experiments.experiment ...`` (the same as ``kvserve experiment``)."""
    parser = argparse.ArgumentParser(prog="kvserve")
    add_experiment_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["experiment", *(sys.argv[1:] if argv is None else argv)])
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
