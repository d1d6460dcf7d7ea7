"""Figures of routing experiments: per-run summaries, CSV files and plots.

A run is one policy at one rate over one request stream, simulated
(``SimulationResult``) or live (``LiveResult``): both hold one
``RequestRecord`` per request, times in (model) seconds.  Its summary:

* ``hit_rate``: prompt tokens served from a prefix cache / prompt tokens;
  ``hit_vs_infinite``: that over the stream's infinite-cache hit rate;
* TTFT (milliseconds, two decimals: close policies differ by fractions of a
  millisecond) and end-to-end latency percentiles (seconds);
* ``throughput``: output tokens per second from the first arrival to the last finish;
* ``load_imbalance``: max / mean over replicas of the measured requests each
  served (the steady state: a warm-up's are left out);
  ``busy_imbalance``: the same for the time each spent running steps, the
  whole run;
* ``num_preemptions``.

A live run does not see its replicas' steps: its busy imbalance and
preemptions are ``None`` (shown as "-", and blank in the CSV files).
"""

from __future__ import annotations

import csv
import dataclasses
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

import numpy as np

from kvserve.experiments.report import count
from kvserve.scheduler.simulation.simulator import RequestRecord


class RunResult(Protocol):
    """What the figures need of a run: ``SimulationResult`` and ``LiveResult`` have it.

    ``replica_busy_time`` is empty when the run did not see its replicas'
    steps; their preemptions are unknown then too.
    """

    @property
    def policy(self) -> str: ...
    @property
    def records(self) -> Sequence[RequestRecord]: ...
    @property
    def replica_num_requests(self) -> Sequence[int]: ...
    @property
    def replica_busy_time(self) -> Sequence[float]: ...
    @property
    def end_time(self) -> float: ...
    @property
    def wall_time(self) -> float: ...


def progress_line(label: str, num_finished: int, num_requests: int, elapsed_s: float) -> str:
    """The line a run (simulated or live) reports as its requests finish."""
    return (
        f"  {label}: {100 * num_finished // num_requests:3d}% ({num_finished}/{num_requests} requests, "
        f"{elapsed_s:.1f} s)"
    )


# --help's account of the CSV files: every column, with its unit (times are the model's seconds:
# a live run's wall-clock times divided by --time-scale).
CSV_COLUMNS_HELP = """\
summary.csv, one row per run (policy at a rate), over its measured requests:
  workload, num_replicas, policy
  qps                  offered load, requests/s (a trace replayed as recorded: its mean rate; one whose
                       requests all arrive at one instant: their number, as if over 1 s)
  num_requests         measured requests (a warm-up's are served, not counted)
  hit_rate             prompt tokens served from a prefix cache / prompt tokens (0-1)
  infinite_hit_rate    the same for one infinite cache over the same stream (0-1)
  hit_vs_infinite      hit_rate / infinite_hit_rate (blank when that is 0; higher is better)
  ttft_p50, ttft_p99   time to first token percentiles, seconds (the table shows milliseconds)
  e2e_p50, e2e_p99     arrival to last token percentiles, seconds
  throughput           output tokens/s, from the first measured arrival to the run's end
  load_imbalance       max / mean over replicas of the measured requests each served (1 = even)
  busy_imbalance       max / mean over replicas of the time each spent running steps, whole run
                       (blank for --live: its replicas' steps are not seen)
  num_preemptions      preemptions of the measured requests (blank for --live)
  wall_seconds         wall-clock seconds the run took
requests.csv, one row per request and run, warm-up included:
  policy, qps          as in summary.csv
  index                the request's position in the stream (arrival order)
  arrival_time         seconds from the start of the run (time 0)
  ttft, latency        time to first token and arrival to last token, seconds
  replica_id           the replica that served it
  num_prompt_tokens, num_cached_tokens (of the prompt, served from a prefix cache), num_output_tokens
  num_preemptions      times it was preempted (blank for --live)
  measured             1: counted in summary.csv; 0: warm-up
"""

REQUEST_CSV_FIELDS = (
    "policy", "qps", "index", "arrival_time", "ttft", "latency", "replica_id",
    "num_prompt_tokens", "num_cached_tokens", "num_output_tokens", "num_preemptions", "measured",
)


@dataclass(frozen=True, slots=True)
class RunSummary:
    """The headline figures of one run."""

    workload: str
    num_replicas: int
    qps: float
    policy: str
    num_requests: int
    hit_rate: float
    infinite_hit_rate: float
    hit_vs_infinite: float | None  # None when an infinite cache would hit nothing
    ttft_p50: float
    ttft_p99: float
    e2e_p50: float
    e2e_p99: float
    throughput: float
    load_imbalance: float
    busy_imbalance: float | None
    num_preemptions: int | None
    wall_seconds: float


def summarize(
    result: RunResult,
    *,
    workload: str,
    qps: float,
    infinite_hit_rate: float,
    measured: Sequence[bool] | None = None,
) -> RunSummary:
    """The figures of ``result`` over its measured requests (all when ``measured`` is ``None``).

    The load per replica counts the measured requests; busy time covers the whole run, warm-up included.
    """
    records = result.records if measured is None else [r for r in result.records if measured[r.index]]
    if not records:
        raise ValueError("cannot summarise a run without requests")
    ttft = np.array([r.ttft for r in records])
    latency = np.array([r.latency for r in records])
    num_prompt = sum(r.num_prompt_tokens for r in records)
    hit_rate = sum(r.num_cached_tokens for r in records) / num_prompt
    start = min(r.arrival_time for r in records)
    span = max(result.end_time - start, 1e-9)
    served = np.bincount([r.replica_id for r in records], minlength=len(result.replica_num_requests)).astype(np.float64)
    busy = np.array(result.replica_busy_time, dtype=np.float64)
    sees_steps = _sees_steps(result)
    busy_imbalance = float(busy.max() / busy.mean()) if sees_steps and busy.mean() > 0 else None
    return RunSummary(
        workload=workload,
        num_replicas=len(served),
        qps=qps,
        policy=result.policy,
        num_requests=len(records),
        hit_rate=hit_rate,
        infinite_hit_rate=infinite_hit_rate,
        hit_vs_infinite=hit_rate / infinite_hit_rate if infinite_hit_rate > 0 else None,
        ttft_p50=float(np.percentile(ttft, 50)),
        ttft_p99=float(np.percentile(ttft, 99)),
        e2e_p50=float(np.percentile(latency, 50)),
        e2e_p99=float(np.percentile(latency, 99)),
        throughput=sum(r.num_output_tokens for r in records) / span,
        load_imbalance=float(served.max() / served.mean()),
        busy_imbalance=busy_imbalance,
        num_preemptions=sum(r.num_preemptions for r in records) if sees_steps else None,
        wall_seconds=result.wall_time,
    )


# Each ratio column says which way is better.
SUMMARY_HEADERS = (
    "policy", "qps", "hit rate", "vs infinite (higher is better)", "TTFT p50 ms", "TTFT p99 ms", "e2e p50 s",
    "e2e p99 s", "tok/s", "load max/mean (lower is better)", "busy max/mean (lower is better)", "preempt",
    "TTFT p99 vs baseline (lower is better)",
)


def summary_rows(summaries: Sequence[RunSummary], baseline: str) -> list[list[object]]:
    """Table rows, each with its TTFT p99 as a ratio to ``baseline``'s at the same rate."""
    baseline_p99 = {s.qps: s.ttft_p99 for s in summaries if s.policy == baseline}
    rows: list[list[object]] = []
    for s in summaries:
        reference = baseline_p99.get(s.qps)
        ratio = f"{s.ttft_p99 / reference:.2f}x" if reference else "-"
        rows.append([
            s.policy, f"{s.qps:g}", f"{s.hit_rate:.3f}",
            "-" if s.hit_vs_infinite is None else f"{s.hit_vs_infinite:.3f}",
            f"{s.ttft_p50 * 1e3:.2f}", f"{s.ttft_p99 * 1e3:.2f}", f"{s.e2e_p50:.2f}", f"{s.e2e_p99:.2f}",
            f"{s.throughput:.0f}", f"{s.load_imbalance:.2f}",
            "-" if s.busy_imbalance is None else f"{s.busy_imbalance:.2f}",
            "-" if s.num_preemptions is None else s.num_preemptions, ratio,
        ])
    return rows


def replayed_counts(measured_by_rate: dict[float, Sequence[bool]]) -> str:
    """How many requests the runs replayed and how many of them were measured, for the table's header.

    ``measured_by_rate``: for each rate that ran (as reported), which requests of its stream were
    measured.  A session workload's stream, warm-up included, is longer at a higher rate: then the
    replayed requests are counted per rate, e.g. "519 requests replayed at 8 qps, 615 at 16 qps;
    400 measured (the rest warm-up)".
    """
    if not measured_by_rate:
        raise ValueError("no run to count the requests of")
    num_replayed = {qps: len(flags) for qps, flags in measured_by_rate.items()}
    num_measured = {qps: sum(flags) for qps, flags in measured_by_rate.items()}
    if len(set(num_measured.values())) > 1:  # no workload does this: each rate in full
        return "; ".join(
            f"{count(num_replayed[qps], 'request')} replayed at {qps:g} qps, {num_measured[qps]:,} measured"
            for qps in num_replayed
        ) + " (the rest warm-up)"
    measured = next(iter(num_measured.values()))
    lengths = set(num_replayed.values())
    if lengths == {measured}:
        return count(measured, "request")
    if len(lengths) == 1:
        return f"{count(lengths.pop(), 'request')} replayed, {measured:,} measured (the rest warm-up)"
    (first_qps, first), *rest = num_replayed.items()
    per_rate = [
        f"{count(first, 'request')} replayed at {first_qps:g} qps", *(f"{n:,} at {qps:g} qps" for qps, n in rest)
    ]
    return f"{', '.join(per_rate)}; {measured:,} measured (the rest warm-up)"


@contextmanager
def atomic_open(path: Path, mode: str = "w") -> Iterator[IO]:
    """A file that appears at ``path`` only once written in full.

    It is written as ``path.partial`` and renamed on success, so that an
    interrupted or failed write never leaves a truncated file at ``path``.
    """
    partial = path.with_name(f"{path.name}.partial")
    try:
        with open(partial, mode, newline=None if "b" in mode else "") as file:
            yield file
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_summary_csv(path: Path, summaries: Iterable[RunSummary]) -> None:
    fields = [f.name for f in dataclasses.fields(RunSummary)]
    with atomic_open(path) as out:
        writer = csv.DictWriter(out, fieldnames=fields)
        writer.writeheader()
        for summary in summaries:
            writer.writerow(dataclasses.asdict(summary))


def write_request_rows(
    writer: csv.writer, result: RunResult, qps: float, measured: Sequence[bool]  # type: ignore[valid-type]
) -> None:
    sees_steps = _sees_steps(result)
    for r in result.records:
        writer.writerow([
            result.policy, qps, r.index, f"{r.arrival_time:.6f}", f"{r.ttft:.6f}", f"{r.latency:.6f}",
            r.replica_id, r.num_prompt_tokens, r.num_cached_tokens, r.num_output_tokens,
            r.num_preemptions if sees_steps else "", int(measured[r.index]),
        ])


def _sees_steps(result: RunResult) -> bool:
    """Whether ``result`` saw its replicas' steps (their busy time and preemptions)."""
    return len(result.replica_busy_time) > 0


# (metric, axis label, file name) of each plot.
PLOTS = (
    ("hit_rate", "prefix cache hit rate", "hit_rate_vs_qps.png"),
    ("ttft_p99", "TTFT p99 (ms)", "ttft_p99_vs_qps.png"),
)
# Each policy's line has its own marker and dash pattern, so that lines stay apart where they overlap.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINE_STYLES = ("-", "--", "-.", ":")


def plot_summaries(summaries: Sequence[RunSummary], out_dir: Path) -> list[Path]:
    """``hit_rate_vs_qps.png`` and ``ttft_p99_vs_qps.png``: one line per policy.

    Each policy has its own marker and line style (hollow markers, so that a line
    drawn over another still shows both).  The infinite cache's hit rate at each
    rate is drawn as a gray dotted line.
    """
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(s.policy for s in summaries))
    title = f"{summaries[0].workload}, {count(summaries[0].num_replicas, 'replica')}"
    paths = []
    for metric, label, filename in PLOTS:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        scale = 1e3 if metric == "ttft_p99" else 1.0
        for i, policy in enumerate(policies):
            points = sorted((s.qps, getattr(s, metric) * scale) for s in summaries if s.policy == policy)
            ax.plot(
                [q for q, _ in points], [v for _, v in points], label=policy,
                marker=_MARKERS[i % len(_MARKERS)], markersize=8 - 0.5 * (i % 4), markerfacecolor="none",
                linestyle=_LINE_STYLES[i % len(_LINE_STYLES)], linewidth=1.6,
            )
        if metric == "hit_rate":
            rates = sorted({s.qps for s in summaries})
            infinite = [next(s.infinite_hit_rate for s in summaries if s.qps == q) for q in rates]
            ax.plot(rates, infinite, color="gray", linestyle=":", marker=".", label="infinite cache")
            ax.set_ylim(0, 1.02)
        else:
            ax.set_yscale("log")
            # Plain numbers (80, 200), not powers of ten, on the log axis.
            plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain)
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(label)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / filename
        with atomic_open(path, "wb") as file:
            fig.savefig(file, format="png", dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
