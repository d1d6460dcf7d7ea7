"""``kvserve experiment --seeds``: the experiment once per seed, each into its own folder, then every figure's
mean and min-max over the seeds; and a policy of one's own named alike in the tables of --sim and --live."""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import statistics
from pathlib import Path

import pytest

from kvserve.experiments import experiment, experiment_runs
from kvserve.experiments.experiment import add_experiment_parser, run_experiment
from kvserve.experiments.experiment_seeds import RATIO_METRIC, SUMMARY_METRICS
from kvserve.experiments.experiment_setup import LiveModel

CUSTOM = "tests.scheduler.routing.test_policy_names:LastReplicaPolicy"
SMALL = ["--workload", "shared_prefix", "--workload-arg", "num_groups=4", "--workload-arg", "system_prompt_len=32",
         "--workload-arg", "question_len=8", "--workload-arg", "output_len=4", "--replicas", "2", "--no-plots",
         "--num-requests", "40", "--kv-fraction", "2"]
POLICIES = ["--policies", "round_robin,cache_aware", "--qps", "5,20"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_experiment_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["experiment", *argv])


def run(argv: list[str], capsys) -> str:  # noqa: ANN001
    """Stdout of an experiment that must succeed."""
    assert run_experiment(parse(argv)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def number(text: str) -> float | None:
    return None if text == "" else float(text)


@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A run with --seeds 0,1 (two policies at two rates): its folder and its stdout."""
    out = tmp_path_factory.mktemp("seeds") / "run"
    argv = [*SMALL, *POLICIES, "--seeds", "0,1", "--out", str(out)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert run_experiment(parse(argv)) == 0
    return out, printed.getvalue()


def test_each_seed_runs_the_whole_experiment_into_a_folder_of_its_own(two_seeds: tuple[Path, str]) -> None:
    out, _ = two_seeds

    for seed in (0, 1):
        assert json.loads((out / f"seed-{seed}" / "config.json").read_text())["seed"] == seed
        assert (out / f"seed-{seed}" / "summary.md").stat().st_size > 0
        assert len(read_csv(out / f"seed-{seed}" / "summary.csv")) == 4  # 2 policies x 2 rates
    assert not (out / "summary.csv").exists() and not (out / "requests.csv").exists()
    # Two seeds, two streams: the figures differ.
    first, second = (read_csv(out / f"seed-{seed}" / "summary.csv") for seed in (0, 1))
    assert [row["hit_rate"] for row in first] != [row["hit_rate"] for row in second]


def test_a_seeds_folder_holds_what_a_run_with_that_seed_alone_writes(two_seeds, tmp_path, capsys) -> None:  # noqa: ANN001
    out, _ = two_seeds
    run([*SMALL, *POLICIES, "--seed", "1", "--out", str(tmp_path / "one")], capsys)

    def figures(path: Path) -> list[dict[str, str]]:
        return [{k: v for k, v in row.items() if k != "wall_seconds"} for row in read_csv(path)]

    assert figures(out / "seed-1" / "summary.csv") == figures(tmp_path / "one" / "summary.csv")
    # A run with one seed writes where it always did: no seed folder, no aggregate.
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == [
        "config.json", "requests.csv", "summary.csv", "summary.md"
    ]


def test_the_aggregate_is_the_mean_min_and_max_of_the_seeds_figures(two_seeds: tuple[Path, str]) -> None:
    out, _ = two_seeds
    per_seed = [read_csv(out / f"seed-{seed}" / "summary.csv") for seed in (0, 1)]
    aggregate = read_csv(out / "aggregate.csv")

    assert [(row["policy"], float(row["qps"])) for row in aggregate] == [
        (row["policy"], float(row["qps"])) for row in per_seed[0]
    ]
    for i, row in enumerate(aggregate):
        assert (row["num_seeds"], row["seeds"]) == ("2", "0 1")
        for metric in SUMMARY_METRICS:
            values = [number(summary[i][metric]) for summary in per_seed]
            assert None not in values  # a simulation has every figure
            assert float(row[f"{metric}_mean"]) == pytest.approx(statistics.fmean(values), rel=1e-12, abs=1e-15)
            assert (float(row[f"{metric}_min"]), float(row[f"{metric}_max"])) == (min(values), max(values))


def test_the_ratio_to_the_baseline_is_taken_per_seed_then_aggregated(two_seeds: tuple[Path, str]) -> None:
    out, _ = two_seeds
    per_seed = [read_csv(out / f"seed-{seed}" / "summary.csv") for seed in (0, 1)]

    for row in read_csv(out / "aggregate.csv"):
        ratios = []
        for summary in per_seed:
            [own] = [s for s in summary if s["policy"] == row["policy"] and s["qps"] == row["qps"]]
            [baseline] = [s for s in summary if s["policy"] == "round_robin" and s["qps"] == row["qps"]]
            ratios.append(float(own["ttft_p99"]) / float(baseline["ttft_p99"]))
        assert float(row[f"{RATIO_METRIC}_mean"]) == pytest.approx(statistics.fmean(ratios), rel=1e-12)
        assert float(row[f"{RATIO_METRIC}_min"]) == pytest.approx(min(ratios), rel=1e-12)
        assert float(row[f"{RATIO_METRIC}_max"]) == pytest.approx(max(ratios), rel=1e-12)


def test_the_aggregated_table_is_printed_last_and_kept_in_aggregate_md(two_seeds: tuple[Path, str]) -> None:
    out, printed = two_seeds
    per_seed = [read_csv(out / f"seed-{seed}" / "summary.csv") for seed in (0, 1)]
    p99_ms = [float(summary[1]["ttft_p99"]) * 1e3 for summary in per_seed]  # cache_aware at 5 qps

    *_, header, columns, _, row_rr, row_ca, _, _, wrote = printed.splitlines()
    assert header.startswith("shared_prefix (simulated), 2 replicas, over 2 seeds (0, 1): each cell is the mean "
                             "(min-max) of the seeds' figures; TTFT p99 vs baseline round_robin is taken per seed")
    assert "TTFT p99 ms" in columns and "TTFT p99 vs baseline" in columns
    assert row_ca.split("|")[1].strip() == "cache_aware" and row_ca.split("|")[2].strip() == "5"
    cell = f"{statistics.fmean(p99_ms):.2f} ({min(p99_ms):.2f}-{max(p99_ms):.2f})"
    assert cell in row_ca
    assert wrote == f"wrote {out / 'aggregate.csv'}, {out / 'aggregate.md'}"
    assert row_ca in (out / "aggregate.md").read_text() and row_rr.split("|")[1].strip() == "round_robin"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--seeds", "0,x"], "--seeds must be comma-separated integers >= 0, got '0,x'"),
        (["--seeds=-1,2"], "--seeds must be comma-separated integers >= 0, got '-1,2'"),
        (["--seeds", "0,,1"], "--seeds must be comma-separated integers >= 0, got '0,,1'"),
        (["--seeds", "3"], "--seeds needs two seeds or more to aggregate over, got '3'; for one, give --seed"),
        (["--seeds", "1,2,1"], "--seeds names 1 more than once"),
        (["--seeds", "0,1", "--seed", "0"], "--seed and --seeds do not combine"),
        (["--seeds", "0,1", "--qps", "knee"], "--seeds does not combine with --qps knee: each seed would find"),
    ],
)
def test_bad_seeds_are_refused_in_one_line_before_anything_runs(tmp_path, capsys, extra, message) -> None:  # noqa: ANN001
    qps = [] if "knee" in extra else ["--qps", "5"]
    argv = [*SMALL, "--policies", "round_robin", *qps, *extra, "--out", str(tmp_path / "run")]

    assert run_experiment(parse(argv)) == 2

    err = capsys.readouterr().err
    assert err.startswith(f"kvserve experiment: error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def an_earlier_run(out: Path, seeds: tuple[int, ...] = ()) -> None:
    """The files of a finished run in ``out`` (one with --seed, and one with --seeds ``seeds``)."""
    out.mkdir(parents=True)
    for name in (*experiment.RESULT_FILES, "config.json"):
        (out / name).write_text("an earlier run")
    for seed in seeds:
        (out / f"seed-{seed}").mkdir()
        for name in (*experiment.RESULT_FILES, "config.json"):
            (out / f"seed-{seed}" / name).write_text("an earlier run")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policies", "bogus"], "unknown policies bogus"),
        (["--policies", "round_robin", "--workload-arg", "num_groups=-1"], "num_groups"),
    ],
)
def test_a_command_refused_for_its_settings_leaves_an_earlier_runs_results(  # noqa: ANN001
    tmp_path, capsys, extra, message
) -> None:
    out = tmp_path / "run"
    an_earlier_run(out, seeds=(0, 5))
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))

    assert run_experiment(parse([*SMALL, "--qps", "5", *extra, "--seeds", "0,1", "--out", str(out)])) == 2

    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("kvserve experiment: error: ") and message in error, error
    assert "seed 0" not in error  # the settings' error, whatever the seed
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before


def test_a_seeds_run_leaves_no_file_or_seed_folder_of_an_earlier_run(tmp_path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "run"
    an_earlier_run(out, seeds=(0, 1, 2))
    (out / "seed-3").mkdir()
    (out / "seed-3" / "notes.txt").write_text("mine")  # not the experiment's: kept, and its folder
    (out / "mine.txt").write_text("mine")

    run([*SMALL, "--policies", "round_robin", "--qps", "5", "--seeds", "0,1", "--out", str(out)], capsys)

    assert sorted(p.name for p in out.iterdir()) == [*experiment_seeds_files(), "mine.txt", "seed-0", "seed-1", "seed-3"]
    assert [p.name for p in (out / "seed-3").iterdir()] == ["notes.txt"]
    for seed in (0, 1):  # this run's own
        assert json.loads((out / f"seed-{seed}" / "config.json").read_text())["seed"] == seed


def test_a_single_run_leaves_no_seed_folder_of_an_earlier_seeds_run(tmp_path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "run"
    an_earlier_run(out, seeds=(0, 1))

    run([*SMALL, "--policies", "round_robin", "--qps", "5", "--out", str(out)], capsys)

    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "requests.csv", "summary.csv", "summary.md"]


def experiment_seeds_files() -> list[str]:
    """What a --seeds run writes at the top of --out."""
    return ["aggregate.csv", "aggregate.md"]


def test_a_policy_of_ones_own_is_named_as_policies_names_it_in_sim_and_live_alike(  # noqa: ANN001
    tmp_path, capsys, monkeypatch
) -> None:
    argv = [*SMALL, "--policies", f"round_robin,{CUSTOM}", "--baseline", CUSTOM, "--qps", "5"]
    sim = run([*argv, "--sim", "--out", str(tmp_path / "sim")], capsys)

    # --live with its runs simulated: the result carries the policy's name attribute, as a simulation's does.
    monkeypatch.setattr(experiment, "live_model", lambda args: LiveModel("unused", 32_000))
    monkeypatch.setattr(experiment_runs, "run_live_all", lambda runs, stream, fleet, model_dir, args: [
        (r, experiment_runs.run_one(r, stream, fleet, 1)) for r in runs
    ])
    live = run([*argv, "--live", "--out", str(tmp_path / "live")], capsys)

    for out, printed in ((tmp_path / "sim", sim), (tmp_path / "live", live)):
        assert [row["policy"] for row in read_csv(out / "summary.csv")] == ["round_robin", CUSTOM]
        assert {row["policy"] for row in read_csv(out / "requests.csv")} == {"round_robin", CUSTOM}
        # --baseline names it so too: its own row is 1.00x of itself (it was "-" in --sim).
        [row] = [line for line in printed.splitlines() if line.startswith(f"| {CUSTOM} ")]
        assert row.rstrip(" |").endswith("1.00x")
        assert "last_replica" not in printed
