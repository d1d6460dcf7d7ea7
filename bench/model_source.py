"""Which model a GPU benchmark times: ``--model DIR``, ``--shape NAME`` or a fresh tiny Llama.

``--shape`` writes a model of a published size with random weights
(``kvserve.worker.full_size_model``): no model hub is needed, and a step's
time depends on the shapes, not on the values.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from kvserve.bench.arg_types import model_directory
from kvserve.worker.full_size_model import SHAPES, create_full_size_model
from kvserve.worker.model_config import ModelConfig
from kvserve.worker.tiny_model import create_tiny_model, tiny_config


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--shape`` (one or neither), and ``--device``."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", type=model_directory, metavar="DIR",
                        help="model directory, with its config.json (default: a fresh tiny Llama)")
    source.add_argument("--shape", choices=sorted(SHAPES),
                        help="time a model of this published shape with random weights")
    parser.add_argument("--device", type=device_name, help="cpu or cuda (default: cuda when available)")


def device_name(text: str) -> str:
    """An argparse ``type``: ``cpu``, or ``cuda`` where a CUDA device is visible, else a usage error."""
    if text not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}")
    if text == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("cuda: no CUDA device is visible")
    return text


def model_dir_for(args: argparse.Namespace, scratch: Path, **tiny_overrides: Any) -> Path:
    """The model ``args`` name, written under ``scratch`` unless it is ``--model``'s directory.

    ``tiny_overrides`` are config fields of the tiny Llama made without either flag.
    """
    if args.model is not None:
        return args.model
    if args.shape is not None:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        print(f"writing a {args.shape} checkpoint with random weights to {scratch} ...", flush=True)
        return create_full_size_model(scratch / args.shape, args.shape, device=device, seed=args.seed)
    return create_tiny_model(scratch / "tiny", "llama", seed=args.seed, **tiny_overrides)


def model_vocab_size(args: argparse.Namespace) -> int:
    """The vocabulary of the model ``model_dir_for(args, ...)`` gives, known before it is written.

    Raises ``ValueError`` when ``--model``'s config cannot be read.
    """
    if args.model is not None:
        return ModelConfig.from_pretrained(args.model).vocab_size
    if args.shape is not None:
        return SHAPES[args.shape][1]["vocab_size"]
    return tiny_config("llama").vocab_size
