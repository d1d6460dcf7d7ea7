"""The ``kvserve`` command line: the top layer, which assembles the subcommands of the layers below.

Each subcommand is one ``add_<name>_parser`` function that registers its
arguments and sets ``handler`` to the function that runs it; ``main`` only
parses and dispatches.  ``serve`` lives in ``kvserve.cluster.cli_serve``, ``generate`` in
``kvserve.cluster.cli_generate``, ``experiment`` in ``kvserve.experiments``.  Heavy imports
(torch, transformers) happen inside the handlers so that ``kvserve --help``
stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from kvserve.cluster.cli_config_file import parse_args_with_config_file
from kvserve.cluster.cli_generate import add_generate_parser
from kvserve.cluster.cli_serve import add_serve_parser
from kvserve.cluster.log_format import OneLineFormatter
from kvserve.experiments.experiment import add_experiment_parser

_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvserve`` command line and return its exit status."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Where a command does not handle it itself: while modules load, or a
        # model is created, before serve's own handling starts (a traceback).
        print("kvserve: interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args_with_config_file(parser, _subcommand_parser(parser, "serve"), argv, "serve")
    except ValueError as exc:
        print(f"kvserve serve: error: {exc}", file=sys.stderr)
        return 2
    level = log_level(args)
    stderr = logging.StreamHandler()
    stderr.setFormatter(OneLineFormatter())
    logging.basicConfig(level=level, handlers=[stderr])
    if level > logging.DEBUG:
        # NOTE: gRPC's core logs its INFO lines raw on stderr (a failed TLS handshake's, before the error
        # that says the same); -v keeps them.
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    return args.handler(args)


def log_level(args: argparse.Namespace) -> int:
    """``--log-level`` when given, else DEBUG with ``-v``, else WARNING."""
    if args.log_level is not None:
        return _LOG_LEVELS[args.log_level]
    return logging.DEBUG if args.verbose else logging.WARNING


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve",
        description="kvserve: a Ray-distributed LLM serving cluster with fleet-wide prefix caching.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {kvserve_version()}")
    _add_logging_arguments(parser, defaults=True)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_create_tiny_model_parser(subparsers)
    add_serve_parser(subparsers)
    add_generate_parser(subparsers)
    add_experiment_parser(subparsers)
    for subparser in subparsers.choices.values():
        # After the subcommand too: `kvserve serve --log-level debug`.
        _add_logging_arguments(subparser, defaults=False)
    return parser


def _subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    return subparsers.choices[name]


def kvserve_version() -> str:
    """The installed distribution's version (pyproject's ``version``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvserve")
    except PackageNotFoundError:  # run from a checkout that is not installed
        from kvserve import __version__

        return __version__


def _add_logging_arguments(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """``-v/--verbose`` and ``--log-level``; only the main parser sets their defaults.

    NOTE: a subcommand's parser writes its defaults over the main parser's values, so
    there they are suppressed: ``kvserve -v serve`` stays verbose.
    """
    group = parser.add_argument_group("logging")
    group.add_argument(
        "-v", "--verbose", action="store_true", default=False if defaults else argparse.SUPPRESS,
        help="log at DEBUG level (same as --log-level debug)",
    )
    group.add_argument(
        "--log-level", type=str.lower, choices=tuple(_LOG_LEVELS), metavar="LEVEL",
        default=None if defaults else argparse.SUPPRESS,
        help=f"log at LEVEL: {', '.join(_LOG_LEVELS)} (default: warning, or debug with -v)",
    )


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
    except OSError as exc:  # a path under a file, an unwritable or read-only place
        print(f"kvserve create-tiny-model: error: {args.directory}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"created tiny {args.family} model (seed {args.seed}) in {path}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
