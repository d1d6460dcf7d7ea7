"""The ``kvserve`` command line.

Each subcommand is one ``add_<name>_parser`` function that registers its
arguments and sets ``handler`` to the function that runs it; ``main`` only
parses and dispatches.  Heavy imports (torch, transformers) happen inside the
handlers so that ``kvserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import ast
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.cluster.cli_config_file import expand_config_file
from kvserve.cluster.host_port import split_host_port
from kvserve.cluster.request_limits import (
    DEFAULT_MAX_CACHE_SALT_BYTES,
    DEFAULT_MAX_PROMPT_BYTES,
    DEFAULT_MAX_STOP_TOKEN_IDS,
    RequestLimits,
)
from kvserve.scheduler.routing.policies import DEFAULT_POLICY, POLICIES

if TYPE_CHECKING:
    from kvserve.cluster.config import ClusterConfig, ServerConfig
    from kvserve.cluster.launcher import ClusterHandle
    from kvserve.cluster.tls import TlsFiles
    from kvserve.scheduler.simulation.simulated_worker import SimulationConfig

logger = logging.getLogger(__name__)

_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# NOTE: kvserve.cluster.config.DEFAULT_MAX_MESSAGE_BYTES, spelled out for the same reason as
# the two below (a test keeps them equal).
_MAX_MESSAGE_BYTES = 4 * 2**20
# NOTE: kvserve.cluster.worker_actor.WORKER_CPU_RESOURCE, spelled out so that
# `kvserve serve --help` need not import torch (a test keeps the two equal).
_WORKER_CPU_RESOURCE = "kvserve_worker_slot"
# NOTE: kvserve.worker.worker.DEFAULT_CPU_KV_CACHE_BYTES in MiB, for the same
# reason (a test keeps the two equal).
_CPU_KV_CACHE_MIB = 512
# How long `serve` lets the streams in flight finish once told to stop.
_SHUTDOWN_GRACE_S = 5.0
# gRPC's name resolvers: a target that starts with one is not HOST:PORT.
_GRPC_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:")
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
        argv = expand_config_file(_subcommand_parser(parser, "serve"), argv, "serve")
    except ValueError as exc:
        print(f"kvserve serve: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=log_level(args), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    from kvserve.experiments.experiment import add_experiment_parser

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


# -- serve -----------------------------------------------------------------------


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="start a cluster and serve the kvserve.v1.Generation gRPC API and the OpenAI-compatible HTTP API",
        description=(
            "Start the scheduler actor and the model replicas on Ray, then serve "
            "kvserve.v1.Generation, grpc.health.v1 and server reflection over gRPC, and the "
            "OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health, "
            "/metrics) on --http-port, until "
            "interrupted (Ctrl-C or SIGTERM), and shut everything down.  Without --address, "
            "a local Ray instance bound to 127.0.0.1 is started (and stopped at the end); "
            "with --address, the cluster runs on an existing Ray cluster (e.g. after "
            "`ray up`), whose nodes need GPUs, or on CPU the custom resource "
            f"{{'{_WORKER_CPU_RESOURCE}': N}} for N ranks."
        ),
    )
    parser.add_argument(
        "--config", metavar="FILE.yaml", type=Path, default=None,
        help="read flags from a YAML mapping of long flag names (without the dashes) to values; "
        "flags on the command line override it",
    )
    parser.add_argument(
        "--model", metavar="DIR", type=Path, default=None,
        help="Hugging Face model directory (default: the embedded tiny model, created on first use)",
    )
    parser.add_argument(
        "--tp", type=int, default=1, metavar="N",
        help="tensor-parallel ranks per replica (default: 1)",
    )
    parser.add_argument(
        "--replicas", type=int, default=1, metavar="M",
        help="data-parallel replicas (default: 1)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1",
        help="address the gRPC server listens on (default: %(default)s)",
    )
    parser.add_argument(
        "--port", type=int, default=50051, metavar="P",
        help="port to listen on; 0 picks a free one (default: %(default)s)",
    )
    http = parser.add_mutually_exclusive_group()
    http.add_argument(
        "--http-port", type=int, default=8000, metavar="P",
        help="port of the OpenAI-compatible HTTP API on --host; 0 picks a free one (default: %(default)s)",
    )
    http.add_argument(
        "--no-http", action="store_const", const=None, dest="http_port",
        help="serve gRPC only, no HTTP API",
    )
    parser.add_argument(
        "--chat-template", type=Path, default=None, metavar="FILE",
        help="Jinja chat template of /v1/chat/completions (default: the one in the model's tokenizer files)",
    )
    parser.add_argument(
        "--address", default=None, metavar="ADDR",
        help="join an existing Ray cluster: 'auto' or HOST:PORT (default: start a local Ray instance)",
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default=None,
        help="worker device (default: GPUs if the Ray cluster has any now, else CPU; give cuda to join a "
        "cluster whose GPU nodes an autoscaler starts on demand)",
    )
    parser.add_argument(
        "--block-size", type=int, default=16,
        help="tokens per KV-cache block (default: %(default)s)",
    )
    parser.add_argument(
        "--num-blocks", type=int, default=None,
        help="KV-cache blocks per replica, one of them the null block (default: as many as fit in 90%% of a "
        f"GPU's memory less what is in use, or in {_CPU_KV_CACHE_MIB} MiB on CPU)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=256,
        help="most requests running at once per replica (default: %(default)s)",
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=2048,
        help="token budget of one step (default: %(default)s)",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None,
        help="longest prompt + output (default: the model's limit)",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true",
        help="on GPUs, run every step eagerly instead of replaying the CUDA graphs captured at start-up "
        "for decode steps",
    )
    security = parser.add_argument_group("authentication and TLS (both front doors)")
    security.add_argument(
        "--auth-token-file", type=Path, default=None, metavar="FILE",
        help="require 'authorization: Bearer <token>' on every call but health: one token per line, optionally "
        "'token tenant-name'; each tenant gets a prefix cache of its own (default: no authentication; "
        "binding a non-loopback --host without it logs a warning)",
    )
    security.add_argument("--tls-cert", type=Path, default=None, metavar="FILE", help="serve TLS with this PEM certificate chain")
    security.add_argument("--tls-key", type=Path, default=None, metavar="FILE", help="the PEM private key of --tls-cert")
    security.add_argument(
        "--tls-client-ca", type=Path, default=None, metavar="FILE",
        help="with --tls-cert: require client certificates signed by this PEM CA (mutual TLS)",
    )
    limits = parser.add_argument_group("per-request limits (refused with INVALID_ARGUMENT / HTTP 400 naming the limit)")
    limits.add_argument(
        "--max-stop-token-ids", type=int, default=DEFAULT_MAX_STOP_TOKEN_IDS, metavar="N",
        help="stop token ids per request (default: %(default)s)",
    )
    limits.add_argument(
        "--max-cache-salt-bytes", type=int, default=DEFAULT_MAX_CACHE_SALT_BYTES, metavar="N",
        help="bytes of a request's cache salt (default: %(default)s)",
    )
    limits.add_argument(
        "--max-prompt-bytes", type=int, default=DEFAULT_MAX_PROMPT_BYTES, metavar="N",
        help="bytes of a text prompt (default: %(default)s)",
    )
    limits.add_argument(
        "--max-prompt-tokens", type=int, default=None, metavar="N",
        help="tokens of a prompt (default: the model's max_model_len)",
    )
    limits.add_argument(
        "--max-message-bytes", type=int, default=_MAX_MESSAGE_BYTES, metavar="N",
        help="bytes of a request message or HTTP body (default: %(default)s)",
    )
    parser.add_argument(
        "--max-concurrent-requests", type=int, default=1024,
        help="streams in flight before RESOURCE_EXHAUSTED (default: %(default)s)",
    )
    parser.add_argument(
        "--stream-interval", type=float, default=0.02, metavar="S",
        help="at most one message per S seconds on each stream (first tokens and the end go out at once), "
        "so that the tokens of several steps travel together: fewer messages, more latency "
        "(default: %(default)s; 0: every fetch of outputs)",
    )
    parser.add_argument(
        "--max-messages-per-s", type=int, default=1000, metavar="N",
        help="the server's budget of stream messages per second: with many streams, each stream's "
        "interval grows to streams / N (default: %(default)s; 0: no budget)",
    )
    parser.add_argument(
        "--simulated", action="store_true",
        help="run simulated replicas: no model runs (no torch, no weights), each step sleeps the step cost "
        "model's time and samples synthetic tokens; needs --num-blocks, takes CPU worker slots, and "
        "--max-model-len may exceed the model's limit",
    )
    parser.add_argument(
        "--cost-model", type=Path, default=None, metavar="FILE_OR_NAME",
        help="with --simulated: the step cost model, a JSON file or a measured model's name such as "
        "llama-3-8b-h100 (default: StepCostModel.default(), an 8B model on an H100)",
    )
    parser.add_argument(
        "--time-scale", type=float, default=None, metavar="X",
        help="with --simulated: steps last X times the cost model's time (default: 1; 0: no wait at all)",
    )
    parser.add_argument(
        "--placement-timeout", type=float, default=None, metavar="S",
        help="seconds a replica may wait for its GPUs or worker slots (default: 60 on a local "
        "cluster; with --address, no limit, since an autoscaler may still be adding nodes)",
    )
    parser.add_argument(
        "--routing", default=DEFAULT_POLICY, choices=sorted(POLICIES),
        help="the policy that picks each new request's replica (default: %(default)s)",
    )
    parser.add_argument(
        "--routing-arg", action="append", default=[], type=_routing_arg, metavar="KEY=VALUE",
        dest="routing_args",
        help="a keyword argument of the routing policy, e.g. cache_threshold=0.5 for cache_aware; "
        "repeatable.  VALUE is read as a Python literal (a number, True, False, None), else as a "
        "string.  cost_ttft's max_num_batched_tokens defaults to --max-num-batched-tokens",
    )
    parser.set_defaults(handler=run_serve)


def _routing_arg(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as ``(key, value)``, the value read as a Python literal when it is one."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value.strip())
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return key, value


def _routing_args(pairs: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    routing_args: dict[str, Any] = {}
    for key, value in pairs:
        if key in routing_args:
            raise ValueError(f"--routing-arg {key} is given more than once")
        routing_args[key] = value
    return routing_args


def _placement_timeout(args: argparse.Namespace) -> float | None:
    if args.placement_timeout is not None:
        if not (args.placement_timeout > 0 and math.isfinite(args.placement_timeout)):
            raise ValueError(f"--placement-timeout must be a positive number of seconds, got {args.placement_timeout}")
        return args.placement_timeout
    return None if args.address is not None else 60.0


def run_serve(args: argparse.Namespace) -> int:
    import asyncio

    from kvserve.cluster.config import ClusterConfig, ParallelConfig, ServerConfig

    def progress(line: str) -> None:
        print(f"kvserve serve: {line}", flush=True)

    try:
        if args.address is not None:
            from kvserve.cluster.ray_address import parse_gcs_address

            try:
                parse_gcs_address(args.address)
            except ValueError as exc:
                raise ValueError(f"--address: {exc}") from None
        if args.max_messages_per_s < 0:
            raise ValueError(f"--max-messages-per-s must be >= 0 (0: no budget), got {args.max_messages_per_s}")
        server_config = ServerConfig(
            host=args.host,
            port=args.port,
            http_port=args.http_port,
            max_concurrent_requests=args.max_concurrent_requests,
            stream_interval_s=args.stream_interval,
            max_messages_per_s=args.max_messages_per_s or None,
            max_message_bytes=args.max_message_bytes,
            limits=RequestLimits(
                max_stop_token_ids=args.max_stop_token_ids,
                max_cache_salt_bytes=args.max_cache_salt_bytes,
                max_prompt_bytes=args.max_prompt_bytes,
                max_prompt_tokens=args.max_prompt_tokens,
            ),
            auth_token_file=None if args.auth_token_file is None else str(args.auth_token_file),
            tls=_tls_files(args),
        )
        if server_config.auth_token_file is not None:
            from kvserve.cluster.auth import TokenTable

            TokenTable.from_file(server_config.auth_token_file)  # a bad file is told before start-up
        if server_config.tls is not None:
            server_config.tls.server_credentials()
        if not server_config.is_loopback and server_config.auth_token_file is None:
            logger.warning(
                "SERVING WITHOUT AUTHENTICATION on %s: anyone who can reach this address can generate and see "
                "the prefix cache of everyone's requests; pass --auth-token-file FILE", args.host,
            )
            progress(f"WARNING: --host {args.host} without --auth-token-file: no authentication")
        parallel = ParallelConfig(tensor_parallel_size=args.tp, num_replicas=args.replicas)
        model_dir = args.model
        if model_dir is None:
            from kvserve.worker.tiny_model import default_tiny_model_path, ensure_default_tiny_model

            if not (default_tiny_model_path() / "config.json").is_file():
                progress(f"creating the default tiny model in {default_tiny_model_path()}")
            model_dir = ensure_default_tiny_model()
        simulation = _simulation_config(args)
        chat_template = _read_chat_template(args.chat_template)
        config = ClusterConfig(
            model_dir=str(model_dir),
            parallel=parallel,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            device=args.device,
            enforce_eager=args.enforce_eager,
            routing=args.routing,
            routing_args=_routing_args(args.routing_args),
            placement_timeout_s=_placement_timeout(args),
            simulation=simulation,
        )
        from kvserve.cluster.launcher import resolve_model_config

        # Fail on a wrong model directory before starting anything.
        resolve_model_config(config)
    except ValueError as exc:
        print(f"kvserve serve: error: {_in_flag_terms(exc)}", file=sys.stderr)
        return 2

    import ray

    from kvserve.cluster.interrupts import stop_on_sigterm
    from kvserve.cluster.launcher import local_ray_lost, start_cluster
    from kvserve.cluster.server import check_address_free

    try:
        # A taken port or a bad --host, told before the minutes of start-up.
        check_address_free(server_config)
        if server_config.http_port is not None:
            from kvserve.cluster.http_server import bind_socket

            bind_socket(server_config.host, server_config.http_port).close()
        if args.address is None:
            _check_local_gpus(config)
    except RuntimeError as exc:
        print(f"kvserve serve: error: {exc}", file=sys.stderr)
        return 1
    # SIGTERM stops it as Ctrl-C does, at every stage (see kvserve.cluster.interrupts).
    stop_on_sigterm()
    try:
        _init_ray(args.address, config, progress)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        print(f"kvserve serve: error: cannot start or join Ray: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C while Ray started: init_local_ray stopped it (and said so), or a
        # second Ctrl-C cut ray.init short and whatever it started is stopped here.
        ray.shutdown()
        progress("stopped")
        return 0
    handle = None
    status = 0
    try:
        stop_on_sigterm()  # ray.init replaced it
        routing = ", ".join([config.routing, *(f"{k}={v!r}" for k, v in config.routing_args.items())])
        progress(f"serving model {config.model_dir}, routing {routing}")
        handle = start_cluster(config, progress=progress)
        try:
            status = asyncio.run(_serve_until_signalled(handle, server_config, progress, chat_template))
        finally:
            stop_on_sigterm()  # asyncio left it at the default action, which would kill the shutdown below
    except (ValueError, RuntimeError) as exc:
        print(f"kvserve serve: error: {_in_flag_terms(exc)}", file=sys.stderr)
        status = 1
    except KeyboardInterrupt:
        progress("interrupted")
    try:
        if handle is not None:
            progress("shutting down the replicas")
            handle.shutdown()
        if local_ray_lost():
            # A signal to the whole process group stopped Ray's processes too:
            # ray.shutdown() and the interpreter's exit would wait 60 s for the
            # GCS, then end the process with an error.
            progress("Ray's own processes have stopped (a signal to the whole process group stops them too)")
            progress("stopped")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        ray.shutdown()
    except KeyboardInterrupt:
        progress("interrupted again: exiting without a clean shutdown")
        return 130
    progress("stopped")
    return status


def _tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """``--tls-cert``/``--tls-key``/``--tls-client-ca`` as ``TlsFiles``; ``ValueError`` for a partial set."""
    if args.tls_cert is None and args.tls_key is None:
        if args.tls_client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    from kvserve.cluster.tls import TlsFiles

    try:
        return TlsFiles(
            str(args.tls_cert), str(args.tls_key), None if args.tls_client_ca is None else str(args.tls_client_ca)
        )
    except ValueError as exc:
        raise ValueError(f"--{str(exc).replace('_', '-', 1)}") from None


def _read_chat_template(path: Path | None) -> str | None:
    """``--chat-template``'s text; ``ValueError`` for a file that cannot be read or is empty."""
    if path is None:
        return None
    try:
        template = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not template.strip():
        raise ValueError(f"--chat-template {path}: the file is empty")
    return template


def _simulation_config(args: argparse.Namespace) -> SimulationConfig | None:
    """``--simulated``'s settings; ``ValueError`` for a bad cost model or a setting without it."""
    from kvserve.scheduler.simulation.cost_model import StepCostModel
    from kvserve.scheduler.simulation.simulated_worker import SimulationConfig

    if not args.simulated:
        if args.cost_model is not None or args.time_scale is not None:
            raise ValueError("--cost-model and --time-scale need --simulated")
        return None
    cost_model = StepCostModel.default()
    if args.cost_model is not None:
        try:
            cost_model = StepCostModel.load(args.cost_model)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"--cost-model {args.cost_model}: {getattr(exc, 'strerror', None) or exc}") from None
    time_scale = 1.0 if args.time_scale is None else args.time_scale
    return SimulationConfig(cost_model=cost_model, time_scale=time_scale)


# The settings' own checks name their fields; serve's errors name the flags that set them.
_FLAG_OF_FIELD = {
    "tensor_parallel_size": "--tp",
    "num_replicas": "--replicas",
    "port": "--port",
    "http_port": "--http-port",
    "block_size": "--block-size",
    "num_blocks": "--num-blocks",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_model_len": "--max-model-len",
    "max_concurrent_requests": "--max-concurrent-requests",
    "stream_interval_s": "--stream-interval",
    "placement_timeout_s": "--placement-timeout",
    "time_scale": "--time-scale",
}


def _in_flag_terms(error: Exception) -> str:
    """``error``'s message with a leading settings field replaced by its flag."""
    message = str(error)
    field, space, rest = message.partition(" ")
    flag = _FLAG_OF_FIELD.get(field)
    return f"{flag}{space}{rest}" if flag else message


def _check_local_gpus(config: ClusterConfig) -> None:
    """``RuntimeError`` when ``--device cuda`` asks a local cluster for more GPUs than this machine has.

    NOTE: only for the local cluster serve starts itself: a joined cluster may gain GPU
    nodes as it scales up, so there the replicas wait for their placement (and its timeout).
    """
    if config.device != "cuda" or config.simulation is not None:
        return
    import torch

    needed = config.parallel.num_workers
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < needed:
        raise RuntimeError(
            f"--device cuda needs {needed} GPU(s) ({config.parallel.num_replicas} replica(s) x TP "
            f"{config.parallel.tensor_parallel_size}), and this machine has {visible} "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda}); use fewer replicas, --device cpu, "
            f"or --address to join a cluster with GPUs"
        )


def _init_ray(address: str | None, config: ClusterConfig, progress: Callable[[str], None]) -> None:
    from kvserve.cluster.launcher import init_local_ray, join_ray

    if address is not None:
        join_ray(address)
        progress(f"joined the Ray cluster at {address}")
        return

    num_worker_slots = 0
    if config.simulation is not None:
        num_worker_slots = config.parallel.num_workers
    elif config.device != "cuda":
        import torch

        if config.device == "cpu" or not torch.cuda.is_available():
            num_worker_slots = config.parallel.num_workers
    progress("starting a local Ray instance")
    init_local_ray(num_worker_slots, report=progress)
    progress("started a local Ray instance on 127.0.0.1")


async def _serve_until_signalled(
    handle: ClusterHandle, server_config: ServerConfig, progress: Callable[[str], None], chat_template: str | None
) -> int:
    """Serve until SIGINT or SIGTERM (0), or until the scheduler actor dies (1: nothing can serve)."""
    import asyncio
    import signal

    from kvserve.cluster.server import start_server

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = await start_server(handle.scheduler, handle.model_info, server_config)
    http_server = None
    try:
        if server_config.http_port is not None:
            from kvserve.cluster.http_server import start_http_server

            http_server = await start_http_server(server.frontend, server_config, chat_template=chat_template)
            progress(f"OpenAI-compatible API at http://{_url_host(server_config.host)}:{http_server.port}/v1")
        progress(f"listening on {server_config.host}:{server.port} (Ctrl-C to stop)")
        stopped = asyncio.ensure_future(stop.wait())
        lost = asyncio.ensure_future(server.scheduler_lost.wait())
        await asyncio.wait((stopped, lost), return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        lost.cancel()
        if server.scheduler_lost.is_set():
            print(
                "kvserve serve: error: the scheduler actor died, and with it every request in flight; "
                "stopping so that a supervisor can start the server again",
                file=sys.stderr,
            )
            return 1
        progress(f"stopping: finishing the streams in flight (for at most {_SHUTDOWN_GRACE_S:g} s)")
        return 0
    finally:
        # Both front doors at once: the gRPC server's stop ends every stream left after the grace.
        stopping = [server.stop(grace_s=_SHUTDOWN_GRACE_S)]
        if http_server is not None:
            stopping.insert(0, http_server.stop(grace_s=_SHUTDOWN_GRACE_S))
        await asyncio.gather(*stopping)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# -- generate --------------------------------------------------------------------


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="stream one completion from a running server",
        description=(
            "Send PROMPT to a kvserve server and print the completion as it streams in; the "
            "finish reason and the token usage follow on stderr."
        ),
    )
    parser.add_argument("prompt", metavar="PROMPT", help="the prompt text")
    parser.add_argument(
        "--target", default="127.0.0.1:50051", type=_target, metavar="HOST:PORT",
        help="server address, or any gRPC target such as unix:PATH (default: %(default)s)",
    )
    parser.add_argument(
        "--max-tokens", type=_int32, default=None, metavar="N",
        help="tokens to generate at most (server default: 16)",
    )
    parser.add_argument(
        "--temperature", type=float, default=None, metavar="T",
        help="0 is greedy (server default: 1.0)",
    )
    parser.add_argument(
        "--top-p", type=float, default=None, metavar="P",
        help="nucleus sampling mass in (0, 1] (server default: 1.0)",
    )
    parser.add_argument(
        "--top-k", type=_int32, default=None, metavar="K",
        help="sample among the K likeliest tokens; -1 or 0 disables (server default)",
    )
    parser.add_argument("--seed", type=_int64, default=None, help="seed for reproducible sampling")
    parser.add_argument(
        "--ignore-eos", action="store_true",
        help="keep generating past the end-of-sequence token",
    )
    parser.add_argument(
        "--stop", action="append", default=None, metavar="TEXT",
        help="end the completion where its text contains TEXT (not printed); repeatable",
    )
    parser.add_argument(
        "--cache-salt", default="",
        help="share cached prefixes only with requests of the same salt",
    )
    parser.add_argument(
        "--auth-token-file", type=Path, default=None, metavar="FILE",
        help="send the first token of FILE as 'authorization: Bearer <token>' (the server's file format)",
    )
    parser.add_argument(
        "--tls-ca", type=Path, default=None, metavar="FILE",
        help="connect with TLS, trusting the server certificate's PEM CA in FILE",
    )
    parser.add_argument(
        "--timeout", type=_positive_seconds, default=60.0, metavar="S",
        help="deadline of the call in seconds (default: %(default)s)",
    )
    parser.set_defaults(handler=run_generate)


def _first_token(path: Path | None) -> str | None:
    """The first token of an auth token file (``ValueError`` when it holds none)."""
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--auth-token-file: cannot read {path}: {exc}") from None
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if fields:
            return fields[0]
    raise ValueError(f"--auth-token-file: {path} holds no token")


def _target(text: str) -> str:
    """A gRPC target: ``HOST:PORT`` checked, one with a resolver's scheme passed on as is."""
    if text.startswith(_GRPC_SCHEMES):
        return text
    try:
        split_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _positive_seconds(text: str) -> float:
    """A deadline: 0 or less expired before the call could start (grpc said only DEADLINE_EXCEEDED)."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (seconds > 0 and math.isfinite(seconds)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return seconds


def _int32(text: str) -> int:
    """An integer of an ``int32`` field (``max_tokens``, ``top_k``); protobuf raised past its range."""
    return _integer_in_range(text, 32)


def _int64(text: str) -> int:
    """An integer of an ``int64`` field (``seed``)."""
    return _integer_in_range(text, 64)


def _integer_in_range(text: str, bits: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):
        low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        raise argparse.ArgumentTypeError(f"must be an integer from {low:,} to {high:,}, got {text}")
    return value


def run_generate(args: argparse.Namespace) -> int:
    try:
        return _generate(args)
    except BrokenPipeError:
        # The channel is closed by then, which cancelled the call and freed the request on the server.
        from kvserve.cluster.interrupts import closed_stdout_status

        return closed_stdout_status()


def _generate(args: argparse.Namespace) -> int:
    from kvserve.cluster.client import Client, RequestError

    names = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
    sampling = {name: getattr(args, name) for name in names}
    try:
        token = _first_token(args.auth_token_file)
    except ValueError as exc:
        print(f"kvserve generate: error: {exc}", file=sys.stderr)
        return 2
    with Client(args.target, token=token, tls_ca=args.tls_ca) as client:
        last = None
        try:
            for delta in client.stream(
                args.prompt, timeout=args.timeout, ignore_eos=args.ignore_eos, cache_salt=args.cache_salt, **sampling
            ):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                last = delta
        except RequestError as exc:
            print(file=sys.stdout if last is not None else sys.stderr)
            print(f"kvserve generate: error: {exc.code}: {exc.message}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print()
            return 130
    print()
    if last is not None and last.usage is not None:
        usage = last.usage
        print(
            f"[{last.finish_reason}] prompt {usage.prompt_tokens} tokens ({usage.cached_prompt_tokens} cached), "
            f"completion {usage.completion_tokens} tokens, replica {last.replica}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
