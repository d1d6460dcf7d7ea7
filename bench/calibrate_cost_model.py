"""Calibrate the step cost model on a real replica and save it as JSON.

Runs plans of varied shapes (pure prefills, decode batches at several
context lengths, decodes with a prefill mixed in) through a real
``kvserve.LLM`` engine's executor, times each step, and fits
``a + b * prefill tokens + c * decode requests + d * context tokens`` by
least squares.  Prints the measured and the modelled time of every shape,
and the fit's error against the mean step time (the baseline a constant
model would give).

    python -m kvserve.bench.calibrate_cost_model --out cost.json [--model DIR | --shape NAME] [--quick]

``--shape llama-3-8b`` (or another published shape) times a model of that size
with random weights, written to a temporary directory first (no model hub is
needed; on a GPU the 16 GB of weights are drawn in seconds).  Without ``--model``
or ``--shape`` a fresh tiny random Llama is used (useful to test the pipeline;
its coefficients say nothing about a real GPU).  The JSON also says, under
``"calibration"``, what was timed: the model, the device, dtype and torch threads,
the block size, the number of step shapes, the fit's mean relative error, the date.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from kvserve import LLM
from kvserve.bench.arg_types import int_at_least, positive_ints, unwritable_reason
from kvserve.bench.model_source import add_model_arguments, model_dir_for
from kvserve.experiments.report import format_table
from kvserve.scheduler.simulation.calibration import CalibrationGrid, calibrate
from kvserve.scheduler.cost_model import StepCostModel, StepSample

QUICK_GRID = CalibrationGrid(
    prefill_lengths=(16, 64, 256), decode_batches=(1, 4, 16), context_lengths=(32, 128), repeats=3
)


def mean_relative_error(model: StepCostModel, samples: list[StepSample]) -> float:
    """The fit's mean of |modelled - measured| / measured over the timed step shapes."""
    measured = np.array([s.seconds for s in samples])
    modelled = np.array([model.shape_time(s.shape) for s in samples])
    return float(np.mean(np.abs(modelled - measured) / measured))


def describe_fit(model: StepCostModel, samples: list[StepSample]) -> str:
    rows = []
    measured = np.array([s.seconds for s in samples])
    modelled = np.array([model.shape_time(s.shape) for s in samples])
    for sample, predicted in zip(samples, modelled):
        shape = sample.shape
        rows.append([
            shape.num_prefill_tokens, shape.num_decode_requests, shape.num_context_tokens,
            f"{sample.seconds * 1e3:.2f}", f"{predicted * 1e3:.2f}",
            f"{(predicted - sample.seconds) / sample.seconds * 100:+.0f}%",
        ])
    fit_error = mean_relative_error(model, samples)
    constant_error = float(np.mean(np.abs(measured.mean() - measured) / measured))
    table = format_table(
        ["prefill tok", "decodes", "context tok", "measured ms", "model ms", "error"], rows
    )
    summary = format_table(
        ["model", "mean relative error (lower is better)", "ratio to constant (below 1: the fit is better)"],
        [["fitted linear", f"{fit_error:.1%}", f"{fit_error / constant_error:.2f}x"],
         ["constant (baseline)", f"{constant_error:.1%}", "1.00x"]],
    )
    return f"{table}\n\n{summary}"



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where to write the cost model JSON")
    add_model_arguments(parser)
    parser.add_argument("--block-size", type=int_at_least(1), default=16,
                        help="tokens per KV block of the replica timed (default 16)")
    parser.add_argument("--quick", action="store_true", help="a small grid (seconds on a CPU)")
    defaults = CalibrationGrid()
    for name, help_text in (("prefill_lengths", "prompt lengths timed as pure prefills"),
                            ("decode_batches", "decode batch sizes"),
                            ("context_lengths", "context lengths of the decode batches")):
        parser.add_argument(f"--{name.replace('_', '-')}", type=positive_ints,
                            help=f"{help_text}, comma-separated (default {','.join(map(str, getattr(defaults, name)))})")
    parser.add_argument("--repeats", type=int_at_least(1), metavar="N",
                        help=f"times each shape is measured (default {defaults.repeats})")
    parser.add_argument("--seed", type=int_at_least(0), default=0,
                        help="seed of the model's weights and the timed prompts (default 0)")
    parser.add_argument("--threads", type=int_at_least(1), help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args(argv)
    grid = QUICK_GRID if args.quick else defaults
    overrides = {name: value for name in ("prefill_lengths", "decode_batches", "context_lengths", "repeats")
                 if (value := getattr(args, name)) is not None}
    grid = dataclasses.replace(grid, **overrides)
    # Before the minutes of writing a model and timing it: what would fail only at the end.
    num_shapes = len(set(grid.prefill_lengths)) + 2 * len(set(grid.decode_batches)) * len(set(grid.context_lengths))
    if num_shapes < 4:
        parser.error(f"the grid gives {num_shapes} step shapes and fitting 4 coefficients needs 4: add a prefill "
                     "length, a decode batch or a context length")
    if (reason := unwritable_reason(args.out)) is not None:
        parser.error(f"--out {args.out}: {reason}")

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_dir_for(args, Path(tmp))
        llm = LLM(model_dir, block_size=args.block_size, device=args.device, seed=args.seed)
        try:
            vocab_size = llm.model_config.vocab_size
            longest = max(*grid.prefill_lengths, *grid.context_lengths) + 2
            if longest > llm.model_config.max_model_len:
                parser.error(f"the grid's sequences reach {longest} tokens and the model serves at most "
                             f"{llm.model_config.max_model_len}: give shorter prefill or context lengths")
            model, samples = calibrate(
                llm.engine.executor, block_size=args.block_size, vocab_size=vocab_size, grid=grid, seed=args.seed
            )
            worker = llm.engine.executor.worker
            device = torch.cuda.get_device_name(worker.device) if worker.device.type == "cuda" else "cpu"
            dtype = str(worker.dtype).removeprefix("torch.")
        finally:
            llm.shutdown()
    timed = args.model or (f"a {args.shape}-shaped model" if args.shape else "a tiny Llama")
    # Saved with the coefficients: what a reader needs to know whether they fit another setup.
    about = {
        "timed": str(timed), "device": device, "dtype": dtype, "torch_threads": torch.get_num_threads(),
        "block_size": args.block_size, "step_shapes": len(samples),
        "mean_relative_error": round(mean_relative_error(model, samples), 4),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    print(f"calibrated on {timed} ({len(samples)} step shapes)")
    print(describe_fit(model, samples))
    print(f"a={model.a:.4g} s  b={model.b:.4g} s/prefill token  c={model.c:.4g} s/decode  "
          f"d={model.d:.4g} s/context token", flush=True)
    # Printed first: a save that fails now (the file changed since the check) loses no measurement.
    try:
        model.save(args.out, about)
    except OSError as exc:
        print(f"could not write --out {args.out}: {exc.strerror or exc}; the fit is printed above", file=sys.stderr)
        return 1
    print(f"saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
