"""``kvserve serve``: its flags, and the run from flags to a serving cluster."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.cluster.cli_flag_terms import FlagTerms
from kvserve.cluster.cli_serve_engine import CPU_KV_CACHE_MIB, engine_default, add_engine_arguments, engine_config
from kvserve.cluster.cli_serve_engine import warn_of_a_small_tenant_cache_share
from kvserve.cluster.cli_serve_security import add_security_arguments, security_warnings, tls_files
from kvserve.cluster.cli_values import add_cost_model_flag, check_utf8, cost_model_of_flag, key_value
from kvserve.cluster.config import DEFAULT_MAX_QUEUE_WAIT_S, DEFAULT_STEP_TIMEOUT_S
from kvserve.cluster.request_limits import (
    DEFAULT_MAX_CACHE_SALT_BYTES,
    DEFAULT_MAX_PROMPT_BYTES,
    DEFAULT_MAX_STOP_TOKEN_IDS,
    RequestLimits,
)
from kvserve.cluster.serve_runtime import check_local_gpus, init_ray, serve_until_signalled
from kvserve.scheduler.routing.policies import (
    DEFAULT_POLICY,
    POLICIES,
    describe_parameters,
    policy_factory,
    policy_parameters,
)

if TYPE_CHECKING:
    from kvserve.scheduler.simulation.simulated_worker import SimulationConfig

logger = logging.getLogger(__name__)
# NOTE: kvserve.cluster.config.DEFAULT_MAX_MESSAGE_BYTES, spelled out for the same reason as
# the two below (a test keeps them equal).
_MAX_MESSAGE_BYTES = 4 * 2**20
# NOTE: kvserve.cluster.worker_actor.WORKER_CPU_RESOURCE, spelled out so that
# `kvserve serve --help` need not import torch (a test keeps the two equal).
_WORKER_CPU_RESOURCE = "kvserve_worker_slot"


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
        "flags on the command line override it (--no-http the file's http-port, --http-port its no-http, "
        "a repeatable flag its whole list)",
    )
    parser.add_argument(
        "--model", metavar="DIR", type=Path, default=None,
        help="Hugging Face model directory (default: the embedded tiny model, created on first use)",
    )
    parser.add_argument(
        "--tp", type=int, default=None, metavar="N", dest="tensor_parallel_size",
        help=f"tensor-parallel ranks per replica (default: {engine_default('tensor_parallel_size')})",
    )
    parser.add_argument(
        "--replicas", type=int, default=None, metavar="M", dest="num_replicas",
        help=f"data-parallel replicas (default: {engine_default('num_replicas')})",
    )
    parser.add_argument(
        "--host", default="127.0.0.1",
        help="address both servers (gRPC and HTTP) listen on (default: %(default)s)",
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
        "--block-size", type=int, default=None,
        help=f"tokens per KV-cache block (default: {engine_default('block_size')})",
    )
    parser.add_argument(
        "--num-blocks", type=int, default=None,
        help="KV-cache blocks per replica, one of them the null block (default: as many as fit in "
        f"{engine_default('gpu_memory_utilization') * 100:.0f}%% of a "
        f"GPU's memory less what is in use, or in {CPU_KV_CACHE_MIB} MiB on CPU)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=None,
        help=f"most requests running at once per replica (default: {engine_default('max_num_seqs')})",
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None,
        help=f"token budget of one step (default: {engine_default('max_num_batched_tokens')})",
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
    parser.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="plan each step while the workers run the one before (overlapped scheduling): the scheduler's "
        "round trip hides behind their work; outputs stay the same (default: on, but off for --simulated "
        "replicas, whose steps are modelled)",
    )
    add_engine_arguments(parser)
    add_security_arguments(parser)
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
        help="bytes of a request message or HTTP body; over it: gRPC's own RESOURCE_EXHAUSTED, "
        "HTTP 413 (default: %(default)s)",
    )
    parser.add_argument(
        "--max-concurrent-requests", type=int, default=1024,
        help="streams in flight before RESOURCE_EXHAUSTED (default: %(default)s)",
    )
    parser.add_argument(
        "--max-concurrent-requests-per-tenant", type=int, default=None, metavar="N",
        help="with --auth-token-file: one tenant's streams in flight before RESOURCE_EXHAUSTED (HTTP 429), "
        "so that one tenant cannot take every slot of --max-concurrent-requests (default: no limit per tenant)",
    )
    parser.add_argument(
        "--stream-interval", type=float, default=0.02, metavar="S", dest="stream_interval_s",
        help="at most one message per S seconds on each stream (first tokens and the end go out at once), "
        "so that the tokens of several steps travel together: fewer messages, more latency "
        "(0 to 1; default: %(default)s; 0: every fetch of outputs)",
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
    add_cost_model_flag(
        parser, "with --simulated, for the replicas' steps and (unless --routing-arg cost_model names another) "
        "the routing policy's estimates: ",
    )
    parser.add_argument(
        "--time-scale", type=float, default=None, metavar="X",
        help="with --simulated: steps last X times the cost model's time (default: 1; 0: no wait at all)",
    )
    parser.add_argument(
        "--placement-timeout", type=float, default=None, metavar="S", dest="placement_timeout_s",
        help="seconds a replica may wait for its GPUs or worker slots (default: 60 on a local "
        "cluster; with --address, no limit, since an autoscaler may still be adding nodes)",
    )
    parser.add_argument(
        "--step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT_S, metavar="S", dest="step_timeout_s",
        help="seconds a replica's workers may take to answer one step before the replica counts as failed "
        "(its requests move, it is started again): the only way a hung worker is found; a GPU replica's "
        "first steps may compile kernels and a step may prefill a long prompt (default: %(default)g)",
    )
    parser.add_argument(
        "--max-queue-wait", type=float, default=DEFAULT_MAX_QUEUE_WAIT_S, metavar="S", dest="max_queue_wait_s",
        help="while every replica is down and one is starting again, requests wait up to S seconds for it "
        "before they fail with UNAVAILABLE (default: %(default)g; 0: they fail at once)",
    )
    parser.add_argument(
        "--routing", default=DEFAULT_POLICY, type=_routing_name, metavar="POLICY",
        help=f"the policy that picks each new request's replica: one of {', '.join(sorted(POLICIES))}, or "
        "MODULE:CLASS (or MODULE:FACTORY) for one of your own, which must be importable where the scheduler "
        "runs (installed, or on PYTHONPATH) (default: %(default)s)",
    )
    parser.add_argument(
        "--routing-arg", action="append", default=[], type=_routing_arg, metavar="KEY=VALUE",
        dest="routing_args",
        help="a keyword argument of the routing policy, e.g. cache_threshold=0.5 for cache_aware; "
        "repeatable.  VALUE is read as a number, true, false or none (any case), else as a "
        "string.  cost_ttft's max_num_batched_tokens defaults to --max-num-batched-tokens, and its "
        "cost_model (a JSON file or a measured model's name, e.g. cost_model=llama-3-8b-h100: name the "
        "calibrated model of a GPU fleet) to --cost-model with --simulated, else to StepCostModel.default(); "
        "a policy of your own gets them too if it takes arguments of those names",
    )
    # The settings' own checks name their fields; serve's errors name the flags that set them.
    # NOTE: a routing policy's arguments may share the names of serve's settings (cost_model).
    flag_terms = FlagTerms.of_parser(parser, verbatim=frozenset({"routing_args"}))
    parser.set_defaults(handler=run_serve, flag_terms=flag_terms)


def _routing_arg(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as ``(key, value)``, the value read as ``cli_values.setting_value`` reads it."""
    try:
        key, value = key_value(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE with KEY a name, got {text!r}")
    return key, value


def _routing_name(text: str) -> str:
    """``--routing``: a built-in policy's name or ``MODULE:CLASS``, checked (and imported) now."""
    try:
        policy_factory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _routing_args(routing: str, pairs: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """``--routing-arg``'s pairs as the keyword arguments of the policy ``routing``; ``ValueError``
    for a key given twice or one the policy does not take (naming those it takes, with their defaults)."""
    accepted = policy_parameters(routing)
    routing_args: dict[str, Any] = {}
    for key, value in pairs:
        if key in routing_args:
            raise ValueError(f"--routing-arg {key} is given more than once")
        if key not in accepted:
            raise ValueError(
                f"--routing-arg {key}: the routing policy {routing} has no argument {key!r}; "
                f"{describe_parameters(routing)}"
            )
        routing_args[key] = value
    return routing_args


def _placement_timeout(args: argparse.Namespace) -> float | None:
    if args.placement_timeout_s is not None:
        if not (args.placement_timeout_s > 0 and math.isfinite(args.placement_timeout_s)):
            raise ValueError(f"--placement-timeout must be a positive number of seconds, got {args.placement_timeout_s}")
        return args.placement_timeout_s
    return None if args.address is not None else 60.0


def run_serve(args: argparse.Namespace) -> int:
    import asyncio

    from kvserve.cluster.config import ClusterConfig, ServerConfig

    def progress(line: str) -> None:
        print(f"kvserve serve: {line}", flush=True)

    try:
        check_utf8(args.host, "--host")
        if args.address is not None:
            check_utf8(args.address, "--address")
            from kvserve.cluster.ray_address import parse_gcs_address

            try:
                parse_gcs_address(args.address)
            except ValueError as exc:
                raise ValueError(f"--address: {exc}") from None
        if args.max_messages_per_s < 0:
            raise ValueError(f"--max-messages-per-s must be >= 0 (0: no budget), got {args.max_messages_per_s}")
        if args.tenant_cache_share is not None and args.auth_token_file is None:
            raise ValueError("--tenant-cache-share needs an auth token file (--auth-token-file): without it no "
                             "caller has a tenant")
        server_config = ServerConfig(
            host=args.host,
            port=args.port,
            http_port=args.http_port,
            max_concurrent_requests=args.max_concurrent_requests,
            max_concurrent_requests_per_tenant=args.max_concurrent_requests_per_tenant,
            stream_interval_s=args.stream_interval_s,
            max_messages_per_s=args.max_messages_per_s or None,
            max_message_bytes=args.max_message_bytes,
            limits=RequestLimits(
                max_stop_token_ids=args.max_stop_token_ids,
                max_cache_salt_bytes=args.max_cache_salt_bytes,
                max_prompt_bytes=args.max_prompt_bytes,
                max_prompt_tokens=args.max_prompt_tokens,
            ),
            auth_token_file=None if args.auth_token_file is None else str(args.auth_token_file),
            tls=tls_files(args),
            monitoring_tenants=tuple(args.monitoring_tenants),
        )
        if server_config.auth_token_file is not None:
            from kvserve.cluster.auth import TokenTable

            # A bad file is told before start-up.
            TokenTable.from_file(server_config.auth_token_file).check_tenant_names(
                server_config.monitoring_tenants, flag="--monitoring-tenant"
            )
        # NOTE: log records only (one line each, which --log-level governs), not progress lines as well.
        if not server_config.is_loopback and server_config.auth_token_file is None:
            logger.warning(
                "SERVING WITHOUT AUTHENTICATION on %s: anyone who can reach this address can generate and see "
                "the prefix cache of everyone's requests; pass --auth-token-file FILE", args.host,
            )
        for warning in security_warnings(server_config):
            logger.warning("%s", warning)
        model_dir = args.model
        if model_dir is None:
            from kvserve.worker.tiny_model import default_tiny_model_path, ensure_default_tiny_model_in_a_child

            if not (default_tiny_model_path() / "config.json").is_file():
                progress(f"creating the default tiny model in {default_tiny_model_path()}")
            try:
                model_dir = ensure_default_tiny_model_in_a_child()
            except RuntimeError as exc:
                print(f"kvserve serve: error: {exc}", file=sys.stderr)
                return 1
        _check_kv_cache_size_flags(args)
        simulation = _simulation_config(args)
        chat_template = _read_chat_template(args.chat_template)
        config = ClusterConfig(
            engine_config(args, model_dir),
            routing=args.routing,
            routing_args=_routing_args(args.routing, args.routing_args),
            placement_timeout_s=_placement_timeout(args),
            step_timeout_s=args.step_timeout_s,
            max_queue_wait_s=args.max_queue_wait_s,
            simulation=simulation,
        )
        from kvserve.cluster.launcher import resolve_model_config

        # Fail on a wrong model directory before starting anything.
        resolve_model_config(config)
    except ValueError as exc:
        print(f"kvserve serve: error: {_in_flag_terms(exc, args)}", file=sys.stderr)
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
            check_local_gpus(config)
    except RuntimeError as exc:
        print(f"kvserve serve: error: {exc}", file=sys.stderr)
        return 1
    # SIGTERM stops it as Ctrl-C does, at every stage (see kvserve.cluster.interrupts).
    stop_on_sigterm()
    try:
        init_ray(args.address, config, progress)
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
        progress(f"serving model {config.engine.model}, routing {routing}")
        handle = start_cluster(config, progress=progress)
        if config.engine.cache.tenant_cache_share is not None:  # the pools' sizes are known now
            pool_sizes = [stats.num_kv_blocks for stats in ray.get(handle.scheduler.get_stats.remote())]
            warn_of_a_small_tenant_cache_share(config.engine, handle.model_info.max_model_len, pool_sizes)
        try:
            status = asyncio.run(serve_until_signalled(handle, server_config, progress, chat_template))
        finally:
            stop_on_sigterm()  # asyncio left it at the default action, which would kill the shutdown below
    except (ValueError, RuntimeError) as exc:
        print(f"kvserve serve: error: {_in_flag_terms(exc, args)}", file=sys.stderr)
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


def _read_chat_template(path: Path | None) -> str | None:
    """``--chat-template``'s text; ``ValueError`` for a file that cannot be read, is empty or does not
    compile."""
    if path is None:
        return None
    try:
        template = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not template.strip():
        raise ValueError(f"--chat-template {path}: the file is empty")
    from kvserve.worker.chat_template import check_chat_template

    try:
        check_chat_template(template)
    except ValueError as exc:
        raise ValueError(f"--chat-template {path}: {exc}") from None
    return template


def _check_kv_cache_size_flags(args: argparse.Namespace) -> None:
    """``ValueError`` for --num-blocks with a flag that sizes the KV cache otherwise (it would do nothing)."""
    if args.num_blocks is None:
        return
    given = [flag for flag, value in (("--cpu-kv-cache-bytes", args.cpu_kv_cache_bytes),
                                      ("--gpu-memory-utilization", args.gpu_memory_utilization))
             if value is not None]
    if given:
        raise ValueError(f"--num-blocks sets the KV cache's size, which {' and '.join(given)} would set otherwise: "
                         "give one of them")


def _simulation_config(args: argparse.Namespace) -> SimulationConfig | None:
    """``--simulated``'s settings; ``ValueError`` for a bad cost model or a setting without it."""
    from kvserve.scheduler.simulation.simulated_worker import SimulationConfig

    if not args.simulated:
        given = [flag for flag, value in (("--cost-model", args.cost_model), ("--time-scale", args.time_scale))
                 if value is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} {'need' if len(given) > 1 else 'needs'} --simulated")
        return None
    cost_model = cost_model_of_flag(args.cost_model)
    time_scale = 1.0 if args.time_scale is None else args.time_scale
    return SimulationConfig(cost_model=cost_model, time_scale=time_scale)


def _in_flag_terms(error: Exception, args: argparse.Namespace) -> str:
    return args.flag_terms.message(error, getattr(args, "settings_from_file", frozenset()), args.config)



