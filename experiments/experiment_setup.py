"""Setting up ``kvserve experiment``: the request stream, the fleet, the policies, the output folder.

Every helper turns a bad setting into an ``ExperimentError`` with a message
that names the option, which the command prints without a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.cluster.cli_values import cost_model_of_flag, key_value
from kvserve.experiments.report import count
from kvserve.experiments.workloads import WorkloadRequest, make_workload
from kvserve.experiments.workloads.cache_reference import CacheReference
from kvserve.experiments.workloads.registry import (
    TRACE_WORKLOAD,
    WORKLOADS,
    check_workload_parameters,
)
from kvserve.cluster.ray_address import parse_gcs_address
from kvserve.scheduler.routing.policies import POLICIES, make_policy, policy_factory, policy_parameters
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.simulation.simulator import FleetConfig

DEFAULT_KV_FRACTION = 0.25
DEFAULT_BURSTINESS = 1.0  # Poisson arrivals
REQUESTS_PER_REPLICA = 250
DEFAULT_NUM_REQUESTS_RANGE = (2_000, 100_000)
DEFAULT_BASELINE = "round_robin"
DEFAULT_KNEE_FACTOR = 5.0
# --live's --time-scale when not given (see experiment_live).
DEFAULT_TIME_SCALE = 5.0
# Below this many of the longest requests per replica cache, the setup says so.
FEW_REQUESTS_IN_CACHE = 4

# Workload parameters that have an option of their own.
WORKLOAD_ARG_OPTIONS = {
    "seed": "--seed", "burstiness": "--burstiness", "num_requests": "--num-requests", "qps": "--qps",
    "trace": "--trace",
}

# The arguments the experiment gives every policy whose constructor or factory names them
# (built-in or module:Class), and the options they come from.
EXPERIMENT_POLICY_ARGS: dict[str, str] = {
    "seed": "--seed",
    "cost_model": "--cost-model",
    "max_num_batched_tokens": "--max-num-batched-tokens",
}


def default_num_requests(num_replicas: int) -> int:
    """Requests per run when ``--num-requests`` is not given: 250 per replica, 2,000 to 100,000.

    Every replica needs a long stream of its own to reach its steady state.
    With 2,000 requests on 64 replicas (31 each), a 64-group shared-prefix
    stream's 64 cold prefills were 3% of it: TTFT p99 was the cold-start time
    under every cache-aware policy, and a replica's request count was mostly
    the sampling noise of its group's popularity (load max/mean 1.3-1.5 for
    any policy that keeps a group on one replica; 1.11-1.16 with 16,000 requests).
    """
    low, high = DEFAULT_NUM_REQUESTS_RANGE
    return min(max(low, REQUESTS_PER_REPLICA * num_replicas), high)


class ExperimentError(ValueError):
    """A bad experiment setup, reported to the user without a traceback."""


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """How to (re)generate the request stream at any rate, in any process."""

    workload: str
    num_requests: int | None  # None: every record of a trace
    seed: int
    burstiness: float
    params: dict[str, Any] = field(default_factory=dict)

    def at(self, qps: float | None) -> list[WorkloadRequest]:
        return make_workload(
            self.workload, self.num_requests, qps, seed=self.seed, burstiness=self.burstiness, **self.params
        )

    def with_vocab_size(self, vocab_size: int) -> StreamSpec:
        """This stream with token ids below ``vocab_size`` (the served model's vocabulary)."""
        given = self.params.get("vocab_size")
        if given is None:
            return dataclasses.replace(self, params={**self.params, "vocab_size": vocab_size})
        if not isinstance(given, int) or given > vocab_size:
            raise ExperimentError(f"--workload-arg vocab_size={given} exceeds the model's vocabulary of {vocab_size}")
        return self


@dataclass(frozen=True, slots=True)
class LiveModel:
    """The model directory a live experiment's front end serves, and its vocabulary size."""

    model_dir: str
    vocab_size: int


def live_model(args: argparse.Namespace) -> LiveModel:
    """Find the model a live experiment serves (``--model``, else the embedded tiny one)."""
    from kvserve.worker.model_config import ModelConfig

    model_dir = args.model
    if model_dir is None:
        from kvserve.worker.tiny_model import ensure_default_tiny_model_in_a_child

        try:
            model_dir = ensure_default_tiny_model_in_a_child()
        except RuntimeError as exc:
            raise ExperimentError(str(exc)) from None
    try:
        model = ModelConfig.from_pretrained(model_dir)
    except (ValueError, OSError) as exc:
        raise ExperimentError(f"--model: {exc}") from None
    return LiveModel(str(model_dir), model.vocab_size)


def check_live_options(args: argparse.Namespace) -> None:
    """Check the live-only options: ``ExperimentError`` for one given to a simulated experiment or
    out of range; a live experiment's ``--time-scale`` defaults to ``DEFAULT_TIME_SCALE``."""
    if args.live:
        if args.jobs != 1:
            raise ExperimentError("--jobs is for simulations: live runs go one at a time")
        if args.sim_processes != 1:
            raise ExperimentError("--sim-processes is for simulations")
        if args.time_scale is None:
            args.time_scale = DEFAULT_TIME_SCALE
        elif not (args.time_scale > 0 and math.isfinite(args.time_scale)):
            raise ExperimentError(f"--time-scale must be a positive number, got {args.time_scale}")
        if args.address is not None:
            try:
                parse_gcs_address(args.address)
            except ValueError as exc:
                raise ExperimentError(f"--address: {exc}") from None
        return
    given = [name for name, value in (("--address", args.address), ("--model", args.model),
                                      ("--time-scale", args.time_scale)) if value is not None]
    if given:
        raise ExperimentError(f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} only for --live")


def check_options(args: argparse.Namespace) -> None:
    """``ExperimentError`` for a numeric option out of range (before anything is generated)."""
    for option, value in (("--replicas", args.replicas), ("--num-requests", args.num_requests),
                          ("--jobs", args.jobs), ("--sim-processes", args.sim_processes),
                          ("--block-size", args.block_size),
                          ("--kv-blocks-per-replica", args.kv_blocks_per_replica),
                          ("--max-num-batched-tokens", args.max_num_batched_tokens),
                          ("--max-num-seqs", args.max_num_seqs)):
        if value is not None and value < 1:
            raise ExperimentError(f"{option} must be >= 1, got {value}")
    if args.seed < 0:
        raise ExperimentError(f"--seed must be >= 0, got {args.seed}")
    if args.burstiness is not None and not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        raise ExperimentError(f"--burstiness must be a positive number, got {args.burstiness}")
    if args.kv_fraction is not None and not (args.kv_fraction > 0 and math.isfinite(args.kv_fraction)):
        raise ExperimentError(f"--kv-fraction must be a positive number, got {args.kv_fraction}")


def load_cost_model(args: argparse.Namespace) -> StepCostModel:
    """``--cost-model``'s model, or the default one."""
    try:
        return cost_model_of_flag(args.cost_model)
    except ValueError as exc:
        raise ExperimentError(str(exc)) from None


def parse_key_values(items: Sequence[str], what: str, form: str = "KEY=VALUE") -> list[tuple[str, Any]]:
    """``items`` as (key, value) pairs; ``ExperimentError`` naming ``what`` and ``form`` for an item without ``=``."""
    pairs = []
    for item in items:
        try:
            pairs.append(key_value(item))
        except ValueError:
            raise ExperimentError(f"{what} must be {form}, got {item!r}") from None
    return pairs


def parse_policies(text: str) -> list[str]:
    """``--policies``: known policy names, each once, at least one."""
    policies = [name.strip() for name in text.split(",") if name.strip()]
    if not policies:
        raise ExperimentError(f"--policies names no policy; choose from {', '.join(POLICIES)}")
    unknown = [name for name in policies if name not in POLICIES and ":" not in name]
    if unknown:
        raise ExperimentError(
            f"unknown policies {', '.join(unknown)}; choose from {', '.join(POLICIES)}, or name your own as module:Class"
        )
    for name in policies:
        try:
            policy_factory(name)  # imports a module:Class policy, so that a bad name fails now, in one line
        except ValueError as exc:
            raise ExperimentError(f"--policies: {exc}") from None
    repeated = sorted({name for name in policies if policies.count(name) > 1})
    if repeated:
        raise ExperimentError(f"--policies names {', '.join(repeated)} more than once")
    return policies


def parse_policy_args(items: Sequence[str], policies: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``--policy-arg POLICY.KEY=VALUE`` items by policy; each policy must be one of ``policies``.

    KEY is after the last dot, so POLICY may be ``package.module:Class``.
    """
    parsed: dict[str, dict[str, Any]] = {}
    for key, value in parse_key_values(items, "--policy-arg", "POLICY.KEY=VALUE"):
        policy, dot, name = key.rpartition(".")
        if not dot or not policy or not name.isidentifier():
            raise ExperimentError(f"--policy-arg must be POLICY.KEY=VALUE with a known policy, got {key!r}")
        if policy not in policies:
            if policy not in POLICIES and ":" not in policy:
                raise ExperimentError(f"--policy-arg must be POLICY.KEY=VALUE with a known policy, got {key!r}")
            raise ExperimentError(f"--policy-arg {key}: {policy} is not run (the policies: {', '.join(policies)})")
        if name in EXPERIMENT_POLICY_ARGS and name in _parameters(policy):
            raise ExperimentError(f"--policy-arg {key}: the experiment sets it from {EXPERIMENT_POLICY_ARGS[name]}")
        if name in parsed.get(policy, {}):
            raise ExperimentError(f"--policy-arg {key} is given more than once")
        parsed.setdefault(policy, {})[name] = value
    return parsed


def _parameters(policy: str) -> dict[str, Any]:
    """The named parameters of ``policy``; ``ExperimentError`` for a name that does not resolve."""
    try:
        return policy_parameters(policy)
    except ValueError as exc:
        raise ExperimentError(f"--policies: {exc}") from None


def check_policies(kwargs_by_policy: dict[str, dict[str, Any]], policy_args: dict[str, dict[str, Any]]) -> None:
    """Construct every policy once, so that a bad argument stops the experiment before it starts."""
    for policy, kwargs in kwargs_by_policy.items():
        try:
            make_policy(policy, **kwargs)
        except (ValueError, TypeError) as exc:
            option = "--policy-arg " if policy in policy_args else ""
            raise ExperimentError(f"{option}{policy}: {exc}") from None


def choose_baseline(baseline: str | None, policies: Sequence[str], knee: bool) -> str:
    """The policy ratios are taken against (with ``knee``, whose knee is found).

    Given outside knee mode, it must be one of ``policies``; by default it is
    round robin, or the first policy when round robin is not run.
    """
    if knee:
        baseline = baseline or DEFAULT_BASELINE
        if baseline not in POLICIES and ":" not in baseline:
            raise ExperimentError(f"unknown --baseline {baseline!r}; choose from {', '.join(POLICIES)}")
        try:
            policy_factory(baseline)
        except ValueError as exc:
            raise ExperimentError(f"--baseline: {exc}") from None
        return baseline
    if baseline is None:
        return DEFAULT_BASELINE if DEFAULT_BASELINE in policies else policies[0]
    if baseline not in policies:
        raise ExperimentError(f"--baseline {baseline} is not one of --policies ({', '.join(policies)})")
    return baseline


def workload_arg_error(error: Exception, params: dict[str, Any]) -> ExperimentError | None:
    """``error`` as the error of the ``--workload-arg`` it is about ("--workload-arg num_groups must be
    ..."), when its message starts with a parameter the user gave; otherwise ``None``."""
    if str(error).split(" ", 1)[0] in params:
        return ExperimentError(f"--workload-arg {error}")
    return None


def stream_spec(args: argparse.Namespace) -> StreamSpec:
    """The stream ``args`` describe, checked as far as it can be without generating it."""
    pairs = parse_key_values(args.workload_arg, "--workload-arg")
    params = dict(pairs)
    for key in params:
        if key in WORKLOAD_ARG_OPTIONS:
            raise ExperimentError(f"--workload-arg {key}: use {WORKLOAD_ARG_OPTIONS[key]}")
    repeated = sorted(key for key, times in Counter(key for key, _ in pairs).items() if times > 1)
    if repeated:
        raise ExperimentError(f"--workload-arg {', '.join(repeated)} is given more than once")
    if args.workload == TRACE_WORKLOAD:
        if args.trace is None:
            raise ExperimentError("the mooncake workload needs --trace PATH")
        if args.burstiness is not None:
            raise ExperimentError("--burstiness does not apply to a trace: its arrivals keep the trace's pattern")
        params["trace"] = str(args.trace)
    elif args.workload not in WORKLOADS:
        raise ExperimentError(
            f"unknown workload {args.workload!r}; choose from {', '.join(sorted([*WORKLOADS, TRACE_WORKLOAD]))}"
        )
    elif args.trace is not None:
        raise ExperimentError(f"--trace is for the {TRACE_WORKLOAD} workload, not {args.workload}")
    try:
        check_workload_parameters(args.workload, {key: value for key, value in params.items() if key != "trace"})
    except ValueError as exc:
        raise workload_arg_error(exc, params) or ExperimentError(f"--workload-arg: {exc}") from None
    burstiness = DEFAULT_BURSTINESS if args.burstiness is None else args.burstiness
    return StreamSpec(args.workload, args.num_requests, args.seed, burstiness, params)


def parse_rates(text: str, stream: StreamSpec) -> list[Any]:
    text = text.strip()
    if text == "knee":
        return ["knee"]
    if text == "trace":
        if stream.workload != TRACE_WORKLOAD:
            raise ExperimentError("--qps trace replays a trace's own timing: only for the mooncake workload")
        return [None]
    try:
        rates = [float(q) for q in text.split(",")]
    except ValueError:
        raise ExperimentError(f"--qps must be comma-separated numbers, 'knee' or 'trace', got {text!r}") from None
    if any(not (q > 0 and math.isfinite(q)) for q in rates):
        raise ExperimentError(f"--qps rates must be finite numbers > 0, got {text!r}")
    if len(set(rates)) < len(rates):
        raise ExperimentError(f"--qps rates must differ, got {text!r}")
    return rates


def qps_label(qps: float | None, stream: Sequence[WorkloadRequest]) -> float:
    """The rate a run is reported at: a trace's own mean rate when replayed as recorded (requests all
    at one instant have no rate: their number is reported, as if over 1 s, as --help says)."""
    if qps is not None:
        return qps
    span = stream[-1].arrival_time - stream[0].arrival_time
    # Four significant digits: a trace of one request an hour is not 0 qps.
    return float(f"{(len(stream) - 1) / span:.4g}") if span > 0 else float(len(stream))


def default_policy_kwargs(
    policy: str, seed: int, cost_model: StepCostModel, max_num_batched_tokens: int
) -> dict[str, Any]:
    """The arguments of ``EXPERIMENT_POLICY_ARGS`` that ``policy``'s constructor or factory names."""
    values = {"seed": seed, "cost_model": cost_model, "max_num_batched_tokens": max_num_batched_tokens}
    parameters = _parameters(policy)
    return {name: values[name] for name in EXPERIMENT_POLICY_ARGS if name in parameters}


def describe(
    stream: StreamSpec,
    num_requests: int,
    reference: CacheReference,
    sizing: StreamSpec | None,
    sizing_reference: CacheReference,
    fleet: FleetConfig,
    cost_name: str,
) -> list[str]:
    """The lines that describe the setup; ``num_requests`` is the measured requests of the stream.

    ``reference``: the stream's infinite-cache reference at the reference rate; ``sizing`` and
    ``sizing_reference``: the stream the caches were sized on and its reference (``sizing`` ``None``:
    ``--kv-blocks-per-replica`` set them, and ``sizing_reference`` is ``reference``); ``cost_name``:
    the step cost model's name (``cost_model_name``).
    """
    cost = fleet.cost_model
    params = f" {format_params(stream.params)}" if stream.params else ""
    # The reference rate, which the fleet was sized at: 1 qps, a trace as recorded.
    rate = "as recorded" if stream.workload == TRACE_WORKLOAD else "at 1 qps"
    lines = [
        f"workload {stream.workload}{params}: {count(num_requests, 'request')}, seed {stream.seed}",
        f"prefix working set {rate}: {reference.num_reused_blocks} blocks reused "
        f"({reference.num_distinct_blocks} distinct; infinite-cache hit rate {reference.hit_rate:.3f})",
    ]
    working_set = "the working set"
    if sizing is not None and sizing_reference != reference:  # the caches were not sized on this stream
        length = (
            "all its records" if sizing.num_requests is None
            else f"{sizing.num_requests:,} requests, the default for {count(fleet.num_replicas, 'replica')}"
        )
        changed = {key: value for key, value in sizing.params.items() if stream.params.get(key) != value}
        if changed:  # e.g. prompts_per_group, which must fit the length
            length += f", {format_params(changed)}"
        lines.append(
            f"caches sized on the stream {rate} with {length} (--num-requests sets how long a run measures, "
            f"not the caches): {sizing_reference.num_reused_blocks} blocks reused"
        )
        working_set = "that working set"
    lines += [
        f"fleet: {count(fleet.num_replicas, 'replica')} x {fleet.cache_config.num_usable_blocks} KV blocks "
        f"({fleet.cache_config.num_usable_blocks / max(sizing_reference.num_reused_blocks, 1):.2g} of {working_set}), "
        f"budget {fleet.scheduler_config.max_num_batched_tokens} tokens, max {fleet.scheduler_config.max_num_seqs} seqs",
        f"step cost: a={cost.a:.3g} s, b={cost.b:.3g} s/prefill token, c={cost.c:.3g} s/decode, "
        f"d={cost.d:.3g} s/context token ({cost_name})",
    ]
    cache = fleet.cache_config
    fits = cache.num_usable_blocks // -(-fleet.scheduler_config.max_model_len // cache.block_size)
    if fits < FEW_REQUESTS_IN_CACHE:
        lines.append(
            f"note: a replica's KV cache holds only {fits} of the longest requests at once, so replicas queue "
            "for memory, not compute; --kv-fraction or --kv-blocks-per-replica sets its size"
        )
    return lines


def cost_model_name(args: argparse.Namespace) -> str:
    """How ``--cost-model`` named the step cost model: a measured model's name, a file, or the default."""
    return "StepCostModel.default()" if args.cost_model is None else str(args.cost_model)


def format_params(params: dict[str, Any]) -> str:
    """Workload parameters as the command line takes them: ``num_groups=4 trace=t.jsonl``."""
    return " ".join(f"{key}={value}" for key, value in params.items())
