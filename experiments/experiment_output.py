"""The experiment's output folder: checked before anything is generated, cleared of an earlier run's
results (its seeds' folders included) once the run's settings have passed their checks, and its
``config.json``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from kvserve.experiments.experiment_report import atomic_open
from kvserve.experiments.experiment_setup import (
    DEFAULT_BURSTINESS,
    DEFAULT_KV_FRACTION,
    ExperimentError,
    StreamSpec,
    cost_model_name,
)
from kvserve.experiments.workloads.cache_reference import CacheReference
from kvserve.experiments.workloads.registry import TRACE_WORKLOAD, workload_parameters
from kvserve.scheduler.simulation.simulator import FleetConfig

CONFIG_FILE = "config.json"
_SEED_DIR = re.compile(r"seed-([0-9]+)")  # seed_dir's names


def seed_dir(out: Path, seed: int) -> Path:
    """The folder of ``--seeds``' run with ``seed``."""
    return out / f"seed-{seed}"


def check_output_dir(out: Path) -> None:
    """``ExperimentError`` when ``--out`` could not be made a directory and written to, as far as can be
    told before anything is generated: it, or the nearest folder above it that exists, is not a
    directory or not writable."""
    existing = next((path for path in (out, *out.parents) if path.exists()), None)
    if existing is None:
        return
    if not existing.is_dir():
        raise ExperimentError(f"--out {out}{'' if existing == out else f': {existing}'} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ExperimentError(f"--out {out}: {existing} is not writable")


def prepare_output(
    args: argparse.Namespace,
    result_files: Sequence[str],
    stream: StreamSpec,
    reference: CacheReference,
    sizing_reference: CacheReference,
    fleet: FleetConfig,
    model_dir: str | None,
) -> None:
    """Create ``--out`` (``check_output_dir`` has checked it), remove an earlier run's results there
    (``remove_earlier_results``: its ``result_files``, and its seeds' folders) and write ``config.json``.

    ``stream``: the stream as generated (a live run's ``vocab_size`` added); ``model_dir``: the model
    a live run serves (``None``: a simulation).  The config holds what rebuilds the run: the cost
    model's coefficients, the model directory and every workload parameter, defaults included.
    """
    out: Path = args.out
    config = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()
              if key != "handler"}
    config["sim"] = not args.live  # the default mode, --sim or not
    # Defaults the run applied, as values (null stays for a setting that does not apply).
    if args.burstiness is None and args.workload != TRACE_WORKLOAD:
        config["burstiness"] = DEFAULT_BURSTINESS
    if args.kv_fraction is None and args.kv_blocks_per_replica is None:
        config["kv_fraction"] = DEFAULT_KV_FRACTION
    config["cost_model"] = {"name": cost_model_name(args), **dataclasses.asdict(fleet.cost_model)}
    config["model"] = model_dir
    # Every parameter of the generator (its defaults as values), and those the stream was given
    # besides --workload-arg (a live run's vocab_size, a trace's path).
    config["workload_params"] = {**workload_parameters(stream.workload), **stream.params}
    config["kv_blocks_per_replica_used"] = fleet.cache_config.num_usable_blocks
    config["infinite_cache_hit_rate"] = reference.hit_rate
    config["prefix_working_set_blocks"] = reference.num_reused_blocks
    # The working set --kv-fraction sized the caches on (that of the default stream; see sizing_stream).
    config["sizing_working_set_blocks"] = (
        None if args.kv_blocks_per_replica is not None else sizing_reference.num_reused_blocks
    )
    remove_earlier_results(out, result_files)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with atomic_open(out / CONFIG_FILE) as file:
            file.write(json.dumps(config, indent=2, default=str) + "\n")
    except OSError as exc:
        raise ExperimentError(f"--out {out}: {exc.strerror or exc}") from None


def record_in_config(out: Path, **values: Any) -> None:
    """Add ``values`` to ``out``'s ``config.json`` (what the run found: the knee's rate)."""
    path = out / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
        config.update(values)
        with atomic_open(path) as file:
            file.write(json.dumps(config, indent=2, default=str) + "\n")
    except OSError as exc:
        raise ExperimentError(f"--out {out}: {exc.strerror or exc}") from None


def remove_earlier_results(out: Path, result_files: Sequence[str], keep_seeds: Collection[int] = ()) -> None:
    """Remove an earlier run's ``result_files`` from ``out``, and from each of its seeds' folders
    (``seed-N``, but those of ``keep_seeds``, which this run's seeds clear themselves) those files and
    ``config.json``, then the folder when nothing else is left in it.

    ``result_files`` go in their order (``summary.md`` first: a folder without it holds no finished run).
    Anything else in ``out`` is left alone.
    """
    if not out.is_dir():
        return
    try:
        for name in result_files:
            (out / name).unlink(missing_ok=True)
        for folder in sorted(out.iterdir()):
            seed = _SEED_DIR.fullmatch(folder.name)
            if seed is None or int(seed[1]) in keep_seeds or folder.is_symlink() or not folder.is_dir():
                continue
            for name in (*result_files, CONFIG_FILE):
                (folder / name).unlink(missing_ok=True)
            if not any(folder.iterdir()):
                folder.rmdir()
    except OSError as exc:
        raise ExperimentError(f"--out {out}: {exc.strerror or exc}") from None
