"""``kvserve experiment --seeds``: the whole experiment once per seed, and its figures aggregated over them.

A run's TTFT p99 over a few hundred requests is near the largest TTFT of its
sample, and moves from seed to seed.  With ``--seeds 0,1,2`` the experiment
runs once per seed (the seed of the workload and of the policies; everything
else the same), each into ``--out``/seed-N/ with its usual files, and then
every figure of ``summary.csv`` is aggregated per policy and rate over the
seeds: its mean, its minimum and its maximum.  The TTFT p99 ratio against
the baseline is taken within each seed (the same stream for both policies),
then aggregated the same way.
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvserve.experiments.experiment_report import RunSummary, atomic_open
from kvserve.experiments.experiment_runs import print_progress
from kvserve.experiments.experiment_output import CONFIG_FILE, check_output_dir, remove_earlier_results, seed_dir
from kvserve.experiments.experiment_setup import ExperimentError
from kvserve.experiments.report import count, format_table

# What a run with --seeds writes into --out itself, aggregate.md last: without it, no finished run.
AGGREGATE_FILES = ("aggregate.md", "aggregate.csv")

# The figures of RunSummary that are aggregated, then the ratio taken per seed.
SUMMARY_METRICS = (
    "num_requests", "hit_rate", "infinite_hit_rate", "hit_vs_infinite", "ttft_p50", "ttft_p99", "e2e_p50",
    "e2e_p99", "throughput", "load_imbalance", "busy_imbalance", "num_preemptions",
)
RATIO_METRIC = "ttft_p99_vs_baseline"
METRICS = (*SUMMARY_METRICS, RATIO_METRIC)

# --help's account of aggregate.csv (after that of summary.csv).
AGGREGATE_CSV_HELP = f"""\
with --seeds, each seed's files are in --out/seed-N/, and --out holds aggregate.csv and aggregate.md:
aggregate.csv, one row per policy and rate, over the n seeds:
  workload, num_replicas, policy, qps   as in summary.csv
  num_seeds, seeds     n, and the seeds (space-separated)
  X_mean, X_min, X_max the mean, the smallest and the largest of the n seeds' values of X, for X in
                       {", ".join(SUMMARY_METRICS[:6])},
                       {", ".join(SUMMARY_METRICS[6:])}
                       (summary.csv's columns; blank where a seed's is), and
                       {RATIO_METRIC}: TTFT p99 / the baseline's at the same rate and seed
  min-max is the range of the n values, not a confidence interval: with few seeds, the
  spread of further seeds may well be wider
"""


@dataclass(frozen=True, slots=True)
class ExperimentOutcome:
    """What one experiment (one seed) hands back: its exit status, its runs' summaries, its baseline."""

    status: int
    summaries: list[RunSummary]
    baseline: str


@dataclass(frozen=True, slots=True)
class Spread:
    """The mean, the smallest and the largest of a figure's values over the seeds."""

    mean: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Spread | None:
        """Their spread; ``None`` when any value is (a figure that some seed's run did not have)."""
        if not values or any(value is None for value in values):
            return None
        numbers = [float(value) for value in values if value is not None]
        return cls(sum(numbers) / len(numbers), min(numbers), max(numbers))


@dataclass(frozen=True, slots=True)
class AggregateRow:
    """One policy at one rate, over the seeds: each metric of ``METRICS`` by name."""

    workload: str
    num_replicas: int
    policy: str
    qps: float
    seeds: tuple[int, ...]
    figures: dict[str, Spread | None]


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: two or more distinct integers >= 0, comma-separated."""
    items = [item.strip() for item in text.split(",")]
    if not all(item.isascii() and item.isdigit() for item in items):  # no sign, no blank item
        raise ExperimentError(f"--seeds must be comma-separated integers >= 0, got {text!r}")
    seeds = [int(item) for item in items]
    if len(seeds) < 2:
        raise ExperimentError(f"--seeds needs two seeds or more to aggregate over, got {text!r}; for one, give --seed")
    repeated = sorted({seed for seed in seeds if seeds.count(seed) > 1})
    if repeated:
        raise ExperimentError(f"--seeds names {', '.join(map(str, repeated))} more than once")
    return seeds


def run_each_seed(
    args: argparse.Namespace,
    run_once: Callable[[argparse.Namespace, Callable[[], None]], ExperimentOutcome],
    result_files: Sequence[str],
) -> int:
    """Run the experiment ``args`` describe: once with ``--seed`` (default 0), or once per ``--seeds`` seed and
    then aggregated; returns the exit status.

    ``run_once(args, before_writing)`` runs one experiment, calling ``before_writing`` once its settings have
    passed their checks.  With ``--seeds``, the first seed's call removes an earlier run's results from
    ``--out`` (``result_files`` and ``config.json``, and the folders of seeds this run does not have): a
    command refused for its settings leaves them all.  Each seed's own run clears its folder.
    """
    if args.seeds is None:
        if args.seed is None:
            args.seed = 0
        return run_once(args, lambda: None).status
    if args.seed is not None:
        raise ExperimentError("--seed and --seeds do not combine: --seeds runs the experiment with each of its seeds")
    seeds = parse_seeds(args.seeds)
    if args.qps.strip() == "knee":
        raise ExperimentError(
            "--seeds does not combine with --qps knee: each seed would find a knee of its own; "
            "find it with --seed, then give its rate to --qps"
        )
    out: Path = args.out
    check_output_dir(out)
    started = False

    def remove_the_earlier_run() -> None:
        nonlocal started
        if not started:
            remove_earlier_results(out, (*result_files, CONFIG_FILE), keep_seeds=seeds)
            started = True

    status = 0
    outcomes: list[ExperimentOutcome] = []
    for i, seed in enumerate(seeds, start=1):
        folder = seed_dir(out, seed)
        print_progress(f"seed {seed} ({i} of {len(seeds)}): the experiment with --seed {seed}, into {folder}/")
        seed_args = argparse.Namespace(**vars(args))
        seed_args.seed, seed_args.out = seed, folder
        try:
            outcome = run_once(seed_args, remove_the_earlier_run)
        except ExperimentError as exc:
            if not started:  # the settings', not the seed's
                raise
            raise ExperimentError(f"seed {seed}: {exc}") from None
        status = status or outcome.status
        outcomes.append(outcome)

    rows = aggregate(seeds, outcomes)
    baseline = outcomes[0].baseline
    write_aggregate_csv(out / "aggregate.csv", rows)
    mode = "live, simulated replicas" if args.live else "simulated"
    header = (
        f"{rows[0].workload} ({mode}), {count(rows[0].num_replicas, 'replica')}, over {len(seeds)} seeds "
        f"({', '.join(map(str, seeds))}): each cell is the mean (min-max) of the seeds' figures; TTFT p99 vs "
        f"baseline {baseline} is taken per seed, then aggregated; each seed's own table and files: {out}/seed-N/"
    )
    table = format_table(AGGREGATE_HEADERS, aggregate_table_rows(rows))
    with atomic_open(out / "aggregate.md") as file:
        file.write(f"{header}\n\n{table}\n")
    # Printed once every file is written, as a single run's table is.
    print()
    print(header)
    print(table)
    print(f"wrote {out / 'aggregate.csv'}, {out / 'aggregate.md'}")
    return status


def aggregate(seeds: Sequence[int], outcomes: Sequence[ExperimentOutcome]) -> list[AggregateRow]:
    """Each (policy, rate) over the seeds' outcomes (one per seed, in the same order as ``seeds``).

    Every seed runs the same policies at the same rates in the same order; ``ExperimentError`` if not
    (``--qps knee`` would find a rate per seed).
    """
    runs = [[(s.policy, s.qps) for s in outcome.summaries] for outcome in outcomes]
    if any(other != runs[0] for other in runs[1:]):
        raise ExperimentError("the seeds' experiments ran different policies or rates: they cannot be aggregated")
    per_seed = [_figures(outcome) for outcome in outcomes]
    rows = []
    for i, first in enumerate(outcomes[0].summaries):
        rows.append(AggregateRow(
            workload=first.workload,
            num_replicas=first.num_replicas,
            policy=first.policy,
            qps=first.qps,
            seeds=tuple(seeds),
            figures={metric: Spread.of([figures[i][metric] for figures in per_seed]) for metric in METRICS},
        ))
    return rows


def _figures(outcome: ExperimentOutcome) -> list[dict[str, float | None]]:
    """Each summary's metrics, the ratio to the baseline at the same rate (this seed's) included."""
    baseline_p99 = {s.qps: s.ttft_p99 for s in outcome.summaries if s.policy == outcome.baseline}
    figures = []
    for s in outcome.summaries:
        reference = baseline_p99.get(s.qps)
        values: dict[str, float | None] = {metric: getattr(s, metric) for metric in SUMMARY_METRICS}
        values[RATIO_METRIC] = s.ttft_p99 / reference if reference else None
        figures.append(values)
    return figures


def write_aggregate_csv(path: Path, rows: Sequence[AggregateRow]) -> None:
    fields = ["workload", "num_replicas", "policy", "qps", "num_seeds", "seeds"]
    fields += [f"{metric}_{stat}" for metric in METRICS for stat in ("mean", "min", "max")]
    with atomic_open(path) as out:
        writer = csv.writer(out)
        writer.writerow(fields)
        for row in rows:
            values: list[object] = [
                row.workload, row.num_replicas, row.policy, row.qps, len(row.seeds), " ".join(map(str, row.seeds)),
            ]
            for metric in METRICS:
                spread = row.figures[metric]
                values += ["", "", ""] if spread is None else [spread.mean, spread.min, spread.max]
            writer.writerow(values)


# The printed table: summary.md's main columns, each cell "mean (min-max)"; aggregate.csv has them all.
# (header, metric, scale, format, unit suffix)
_TABLE_COLUMNS = (
    ("hit rate", "hit_rate", 1.0, ".3f", ""),
    ("vs infinite (higher is better)", "hit_vs_infinite", 1.0, ".3f", ""),
    ("TTFT p50 ms", "ttft_p50", 1e3, ".2f", ""),
    ("TTFT p99 ms", "ttft_p99", 1e3, ".2f", ""),
    ("TTFT p99 vs baseline (lower is better)", RATIO_METRIC, 1.0, ".2f", "x"),
    ("e2e p99 s", "e2e_p99", 1.0, ".2f", ""),
    ("tok/s", "throughput", 1.0, ".0f", ""),
    ("load max/mean (lower is better)", "load_imbalance", 1.0, ".2f", ""),
)
AGGREGATE_HEADERS = ("policy", "qps", *(header for header, *_ in _TABLE_COLUMNS))


def aggregate_table_rows(rows: Sequence[AggregateRow]) -> list[list[object]]:
    """Table rows: each figure as ``mean (min-max)``, "-" where a seed had none."""
    table: list[list[object]] = []
    for row in rows:
        cells: list[object] = [row.policy, f"{row.qps:g}"]
        for _, metric, scale, spec, unit in _TABLE_COLUMNS:
            spread = row.figures[metric]
            if spread is None:
                cells.append("-")
                continue
            mean, low, high = (format(value * scale, spec) for value in (spread.mean, spread.min, spread.max))
            cells.append(f"{mean}{unit} ({low}-{high}{unit})")
        table.append(cells)
    return table
