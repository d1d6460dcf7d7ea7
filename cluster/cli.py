"""The ``kvserve`` command line.

Each subcommand is one ``add_<name>_parser`` function that registers its
arguments and sets ``handler`` to the function that runs it; ``main`` only
parses and dispatches.  Heavy imports (torch, transformers) happen inside the
handlers so that ``kvserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvserve`` command line and return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return args.handler(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve",
        description="kvserve: a Ray-distributed LLM serving cluster with fleet-wide prefix caching.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_create_tiny_model_parser(subparsers)
    return parser


def add_create_tiny_model_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "create-tiny-model",
        help="write a tiny random-weight Hugging Face model directory",
        description=(
            "Write a tiny model with seeded random weights (float32) and a byte-level BPE "
            "tokenizer trained on kvserve's bundled corpus, in Hugging Face format: "
            "config.json, model.safetensors, generation_config.json, tokenizer.json, "
            "tokenizer_config.json.  It loads with transformers' AutoModelForCausalLM and "
            "AutoTokenizer.  Its outputs are meaningless text; it exists for tests and "
            "demos where no real checkpoint can be downloaded.  The same family and seed "
            "always give byte-identical files."
        ),
    )
    parser.add_argument(
        "directory", metavar="DIR", type=Path, help="output directory (must not exist, or be empty)"
    )
    parser.add_argument(
        "--family", choices=_FAMILIES, default="llama", help="model architecture (default: %(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights (default: %(default)s)"
    )
    parser.set_defaults(handler=run_create_tiny_model)


def run_create_tiny_model(args: argparse.Namespace) -> int:
    from kvserve.worker.tiny_model import create_tiny_model

    try:
        path = create_tiny_model(args.directory, args.family, seed=args.seed)
    except (ValueError, FileExistsError) as exc:
        print(f"kvserve create-tiny-model: error: {exc}", file=sys.stderr)
        return 2
    print(f"created tiny {args.family} model (seed {args.seed}) in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
