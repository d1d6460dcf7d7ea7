"""Configuration of a running cluster: the gRPC server, and the whole (the engine's
settings, ``EngineConfig``, with the cluster's routing and timeouts).

Each dataclass is frozen and validated once, at construction; an invalid value
raises ``ValueError`` naming the field.  Values that depend on the model
(``max_model_len`` when unset) are derived by the scheduler actor with
``dataclasses.replace``-style construction, never by mutation.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

from kvserve.cluster.request_limits import RequestLimits
from kvserve.scheduler.checks import check_positive_ints
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.cost_model import StepCostModel
from kvserve.scheduler.engine_config import EngineConfig, ParallelConfig
from kvserve.scheduler.routing.policies import DEFAULT_POLICY, make_policy, policy_factory, policy_parameters
from kvserve.scheduler.routing.policy import RoutingPolicy
from kvserve.scheduler.simulation.simulated_worker import SimulatedWorkerConfig, SimulationConfig
from kvserve.worker.host_address import is_loopback
from kvserve.worker.worker_config import WorkerConfig
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.cluster.tls import TlsFiles

DEFAULT_MAX_MESSAGE_BYTES = 4 * 2**20
MAX_GRPC_MESSAGE_BYTES = 2**31 - 1  # a C int in grpc's channel arguments
# NOTE: generous: a GPU replica's first steps may compile kernels, and one step may prefill
# a whole long prompt.  The step-age gauge of /metrics tells of a hung worker sooner.
DEFAULT_STEP_TIMEOUT_S = 120.0
# NOTE: a restarted replica is back in about 5-15 s (a 1 s first wait, then its workers start and load
# the model); twice that covers a slow restart or a failed first try, and a client held longer is better
# told UNAVAILABLE and left to retry elsewhere.  The front end's stream limit bounds how many wait.
DEFAULT_MAX_QUEUE_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The public endpoints: gRPC, and the OpenAI-compatible HTTP API beside it (``http_port``).

    ``port`` 0 binds a free port (the server reports which).  Message sizes are
    explicit limits in both directions; a request larger than
    ``max_message_bytes`` is refused by gRPC itself with ``RESOURCE_EXHAUSTED``.
    More than ``max_concurrent_requests`` streams in flight are refused with
    ``RESOURCE_EXHAUSTED`` too, and so are more than ``max_concurrent_requests_per_tenant``
    of one tenant's (``None``: no limit per tenant; needs ``auth_token_file``, whose tokens
    are the tenants), so that one tenant cannot take every slot of the others.

    Streaming: a request's first tokens and its end go out at once; the tokens
    in between travel together, at most one message per stream per interval,
    because each message costs the server and the client tens of microseconds
    whatever it carries.  The interval is ``stream_interval_s``, or, with many
    streams in flight, ``num_streams / max_messages_per_s`` (the server's
    budget of messages per second; ``None``: no budget).  Outputs are fetched
    from the scheduler at that pace too, except while a stream awaits its
    first tokens.  ``stream_interval_s`` 0 and no budget: every fetch of
    outputs (about one per step) is sent at once.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    # The OpenAI-compatible HTTP API on the same host (0: a free port; None: no HTTP server).
    http_port: int | None = 8000
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_concurrent_requests: int = 1024
    max_concurrent_requests_per_tenant: int | None = None
    stream_interval_s: float = 0.02
    max_messages_per_s: int | None = 1000
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Bearer tokens (see ``kvserve.cluster.auth``): None serves everyone, each client with its own cache salt.
    auth_token_file: str | None = None
    # TLS on both front doors; None: plaintext.
    tls: TlsFiles | None = None
    # The tenants whose tokens may read GetStats and /metrics (cluster-wide figures); empty: every tenant's.
    monitoring_tenants: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty string, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        http_port = self.http_port
        if http_port is not None:
            if isinstance(http_port, bool) or not isinstance(http_port, int) or not 0 <= http_port <= 65535:
                raise ValueError(f"http_port must be in [0, 65535] or None (no HTTP server), got {http_port!r}")
            if http_port != 0 and http_port == self.port:
                raise ValueError(f"http_port must differ from the gRPC server's port, both are {http_port}")
        check_positive_ints(max_message_bytes=self.max_message_bytes)
        if self.max_message_bytes > MAX_GRPC_MESSAGE_BYTES:  # else grpc's OverflowError, once serving started
            raise ValueError(
                f"max_message_bytes must be at most {MAX_GRPC_MESSAGE_BYTES} (gRPC's limit), "
                f"got {self.max_message_bytes}"
            )
        check_positive_ints(max_concurrent_requests=self.max_concurrent_requests)
        if self.max_concurrent_requests_per_tenant is not None:
            check_positive_ints(max_concurrent_requests_per_tenant=self.max_concurrent_requests_per_tenant)
            if self.auth_token_file is None:
                raise ValueError(
                    "max_concurrent_requests_per_tenant needs an auth token file (auth_token_file): its "
                    "tokens are the tenants"
                )
        interval = self.stream_interval_s
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 <= interval <= 1:
            raise ValueError(f"stream_interval_s must be in [0, 1] seconds, got {interval!r}")
        if self.max_messages_per_s is not None:
            check_positive_ints(max_messages_per_s=self.max_messages_per_s)
        if not isinstance(self.limits, RequestLimits):
            raise ValueError(f"limits must be a RequestLimits, got {type(self.limits).__name__}")
        if self.auth_token_file is not None and not isinstance(self.auth_token_file, str):
            raise ValueError(f"auth_token_file must be a path string, got {self.auth_token_file!r}")
        if self.monitoring_tenants and self.auth_token_file is None:
            raise ValueError(
                "monitoring_tenants needs an auth token file (auth_token_file): its tokens are the tenants"
            )

    @property
    def is_loopback(self) -> bool:
        """Whether only this machine can reach the servers."""
        return is_loopback(self.host)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Everything the scheduler actor needs to start and drive the replicas.

    ``engine`` is what every replica runs (``kvserve.scheduler.engine_config``: the
    model, its cache, scheduler, runtime and parallel settings).  The rest is the
    cluster's own:
    ``routing``: the routing policy, by name (a key of ``kvserve.scheduler.routing.policies.POLICIES``,
    or ``module:Class`` for one's own, which the scheduler actor imports);
    ``routing_args``: keyword arguments of its constructor (a ``cost_model`` may be a
    ``StepCostModel``, or a JSON file or measured model's name that ``StepCostModel.load``
    reads, here: the actor may run on another node).  See ``routing_policy`` for the
    arguments the policy takes from the rest of the config.
    ``undelivered_output_timeout_s``: when the front end stops fetching outputs
    for this long, the scheduler aborts the requests whose outputs wait.
    ``placement_timeout_s``: how long a replica may wait for its resources
    (``None``: as long as it takes, for clusters whose autoscaler adds nodes).
    ``step_timeout_s``: a replica whose workers do not answer a step for this long
    fails (and is started again): the only way a hung worker is found.
    ``max_queue_wait_s``: while no replica is available and some replica is starting
    again, a request waits this long for one (0: it fails at once).
    ``simulation``: run simulated replicas (``SimulatedWorker``: no model, no
    torch; each step sleeps the cost model's time) with ``cache.num_blocks`` KV
    blocks each, on CPU worker slots; ``max_model_len`` may then exceed the
    model's own limit.  Under Ray, a single CPU rank takes 1 torch thread unless
    ``runtime.cpu_threads`` says otherwise.
    """

    engine: EngineConfig
    routing: str = DEFAULT_POLICY
    # NOTE: hash=False: a dict is unhashable; equal configs still hash equal.
    routing_args: dict[str, Any] = field(default_factory=dict, hash=False)
    undelivered_output_timeout_s: float = 60.0
    placement_timeout_s: float | None = 60.0
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S
    simulation: SimulationConfig | None = None

    @classmethod
    def from_kwargs(cls, model: str | os.PathLike[str], **kwargs: Any) -> ClusterConfig:
        """The cluster's own fields and the engine's settings (``EngineConfig.from_kwargs``: by
        name, ``block_size=32``, or a whole group, ``parallel=ParallelConfig(...)``)."""
        own = {f.name for f in dataclasses.fields(cls)} - {"engine"}
        cluster_kwargs = {name: kwargs.pop(name) for name in list(kwargs) if name in own}
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        return cls(EngineConfig.from_kwargs(model, **kwargs), **cluster_kwargs)

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"engine must be an EngineConfig, got {type(self.engine).__name__}")
        try:
            policy_factory(self.routing)
        except ValueError as exc:
            raise ValueError(f"routing: {exc}") from None
        if not isinstance(self.routing_args, dict) or not all(isinstance(k, str) for k in self.routing_args):
            raise ValueError(f"routing_args must be a dict of keyword arguments, got {self.routing_args!r}")
        # A copy: the caller may change its dict, the config must not change.
        object.__setattr__(self, "routing_args", _read_cost_model(self.routing, dict(self.routing_args)))
        timeout = self.undelivered_output_timeout_s
        if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"undelivered_output_timeout_s must be a positive number, got {timeout!r}")
        placement = self.placement_timeout_s
        if placement is not None and (
            not isinstance(placement, (int, float)) or not math.isfinite(placement) or placement <= 0
        ):
            raise ValueError(f"placement_timeout_s must be a positive number or None, got {placement!r}")
        step_timeout = self.step_timeout_s
        if isinstance(step_timeout, bool) or not isinstance(step_timeout, (int, float)) or not (
            math.isfinite(step_timeout) and step_timeout > 0
        ):
            raise ValueError(f"step_timeout_s must be a positive number of seconds, got {step_timeout!r}")
        max_wait = self.max_queue_wait_s
        if isinstance(max_wait, bool) or not isinstance(max_wait, (int, float)) or not (
            math.isfinite(max_wait) and max_wait >= 0
        ):
            raise ValueError(
                f"max_queue_wait_s must be a finite number of seconds >= 0 (0: no wait), got {max_wait!r}"
            )
        if self.simulation is not None:
            if not isinstance(self.simulation, SimulationConfig):
                raise ValueError(f"simulation must be a SimulationConfig, got {type(self.simulation).__name__}")
            if self.engine.cache.num_blocks is None:
                raise ValueError("num_blocks is required with simulation: simulated replicas have no memory to size")
        # Fail now, not in the actor, on arguments the policy rejects.
        self.routing_policy()

    @property
    def parallel(self) -> ParallelConfig:
        return self.engine.parallel

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The step scheduler's limits, given the model's (resolved) ``max_model_len``."""
        return self.engine.scheduler_config(max_model_len)

    def routing_policy(self) -> RoutingPolicy:
        """A fresh policy named ``routing``, built with ``routing_args``.

        A policy that takes ``max_num_batched_tokens`` (``cost_ttft``, which
        prices queued work in steps of that budget) gets this config's step
        budget unless ``routing_args`` sets it; with ``simulation``, one that
        takes ``cost_model`` gets the simulated replicas' cost model unless
        ``routing_args`` sets it.
        """
        kwargs = dict(self.routing_args)
        parameters = policy_parameters(self.routing)
        inherits_budget = "max_num_batched_tokens" not in kwargs and "max_num_batched_tokens" in parameters
        if inherits_budget:
            kwargs["max_num_batched_tokens"] = self.engine.scheduler.max_num_batched_tokens
        if self.simulation is not None and "cost_model" not in kwargs and "cost_model" in parameters:
            kwargs["cost_model"] = self.simulation.cost_model
        try:
            return make_policy(self.routing, **kwargs)
        except ValueError as exc:
            if inherits_budget and str(exc).startswith("max_num_batched_tokens"):
                # NOTE: named as the engine's setting it came from, not as a routing argument nobody gave.
                raise ValueError(
                    f"max_num_batched_tokens: the routing policy {self.routing} prices steps of this budget: {exc}"
                ) from None
            raise ValueError(f"routing_args: {exc}") from None

    def cache_config(self, num_blocks: int, model_id: str) -> CacheConfig:
        """One replica's block pool, once its workers have reported ``num_blocks``."""
        return self.engine.cache_config(num_blocks, model_id)

    def worker_config(self, max_model_len: int | None = None) -> WorkerConfig | SimulatedWorkerConfig:
        """The rank-0 template of every replica's workers (the launcher sets rank and init method).

        ``max_model_len`` is the resolved one (``ModelConfig.max_model_len``).
        """
        if self.simulation is not None:
            return SimulatedWorkerConfig(
                simulation=self.simulation,
                num_blocks=self.engine.cache.num_blocks,  # type: ignore[arg-type]  # required with simulation
                tp_size=self.engine.parallel.tensor_parallel_size,
            )
        return WorkerConfig.for_engine(self.engine, max_model_len)


def _read_cost_model(routing: str, routing_args: dict[str, Any]) -> dict[str, Any]:
    """``routing_args`` with a ``cost_model`` given as a file or a measured model's name read
    (``StepCostModel.load``), for a policy that takes one; ``ValueError`` naming it when it cannot be."""
    name = routing_args.get("cost_model")
    if not isinstance(name, (str, os.PathLike)) or "cost_model" not in policy_parameters(routing):
        return routing_args
    try:
        routing_args["cost_model"] = StepCostModel.load(name)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"routing_args: cost_model {name}: {getattr(exc, 'strerror', None) or exc}") from None
    return routing_args
