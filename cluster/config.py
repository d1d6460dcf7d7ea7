"""Configuration of a running cluster: parallelism, the gRPC server, and the whole.

Each dataclass is frozen and validated once, at construction; an invalid value
raises ``ValueError`` naming the field.  Values that depend on the model
(``max_model_len`` when unset) are derived by the scheduler actor with
``dataclasses.replace``-style construction, never by mutation.
"""

from __future__ import annotations

import dataclasses
import inspect
import ipaddress
import math
from dataclasses import dataclass, field

from kvserve.cluster.request_limits import RequestLimits
from kvserve.scheduler.checks import check_block_size, check_num_blocks, check_positive_ints
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.routing.policies import DEFAULT_POLICY, POLICIES, make_policy
from kvserve.scheduler.routing.policy import RoutingPolicy
from kvserve.scheduler.simulation.simulated_worker import SimulatedWorkerConfig, SimulationConfig
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.cluster.tls import TlsFiles
    from kvserve.worker.worker import WorkerConfig

DEFAULT_MAX_MESSAGE_BYTES = 4 * 2**20
_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How many copies of the model (replicas) and how many ranks each (tensor parallel)."""

    tensor_parallel_size: int = 1
    num_replicas: int = 1

    def __post_init__(self) -> None:
        check_positive_ints(tensor_parallel_size=self.tensor_parallel_size)
        check_positive_ints(num_replicas=self.num_replicas)

    @property
    def num_workers(self) -> int:
        return self.tensor_parallel_size * self.num_replicas


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The public endpoints: gRPC, and the OpenAI-compatible HTTP API beside it (``http_port``).

    ``port`` 0 binds a free port (the server reports which).  Message sizes are
    explicit limits in both directions; a request larger than
    ``max_message_bytes`` is refused by gRPC itself with ``RESOURCE_EXHAUSTED``.
    More than ``max_concurrent_requests`` streams in flight are refused with
    ``RESOURCE_EXHAUSTED`` too.

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
    stream_interval_s: float = 0.02
    max_messages_per_s: int | None = 1000
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Bearer tokens (see ``kvserve.cluster.auth``): None serves everyone, each client with its own cache salt.
    auth_token_file: str | None = None
    # TLS on both front doors; None: plaintext.
    tls: TlsFiles | None = None

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
                raise ValueError(f"http_port must differ from port, both are {http_port}")
        check_positive_ints(max_message_bytes=self.max_message_bytes)
        check_positive_ints(max_concurrent_requests=self.max_concurrent_requests)
        interval = self.stream_interval_s
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 <= interval <= 1:
            raise ValueError(f"stream_interval_s must be in [0, 1] seconds, got {interval!r}")
        if self.max_messages_per_s is not None:
            check_positive_ints(max_messages_per_s=self.max_messages_per_s)
        if not isinstance(self.limits, RequestLimits):
            raise ValueError(f"limits must be a RequestLimits, got {type(self.limits).__name__}")
        if self.auth_token_file is not None and not isinstance(self.auth_token_file, str):
            raise ValueError(f"auth_token_file must be a path string, got {self.auth_token_file!r}")

    @property
    def is_loopback(self) -> bool:
        """Whether only this machine can reach the servers."""
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Everything the scheduler actor needs to start and drive the replicas.

    The scheduler fields mirror ``SchedulerConfig`` (``max_model_len`` ``None``:
    the model's own limit); the cache fields mirror ``CacheConfig`` and
    ``WorkerConfig`` (``num_blocks`` ``None``: as many as fit in
    ``gpu_memory_utilization`` on a GPU or ``cpu_kv_cache_bytes`` on a CPU,
    ``None``: the worker's default).
    ``device`` ``None`` uses GPUs when the Ray cluster has any, else CPUs.
    ``cpu_threads``: torch threads of each CPU rank (``None``: the node's
    cores divided among a replica's ranks; 1 thread for a single rank under Ray).
    ``undelivered_output_timeout_s``: when the front end stops fetching outputs
    for this long, the scheduler aborts the requests whose outputs wait.
    ``placement_timeout_s``: how long a replica may wait for its resources
    (``None``: as long as it takes, for clusters whose autoscaler adds nodes).
    ``routing``: the routing policy, by name (``kvserve.scheduler.routing.policies.POLICIES``);
    ``routing_args``: keyword arguments of its constructor.
    ``simulation``: run simulated replicas (``SimulatedWorker``: no model, no
    torch; each step sleeps the cost model's time) with ``num_blocks`` KV
    blocks each, on CPU worker slots; ``max_model_len`` may then exceed the
    model's own limit.
    """

    model_dir: str
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    device: str | None = None
    cpu_kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_threads: int | None = None
    seed: int | None = 0
    # CUDA: run decode steps eagerly instead of replaying CUDA graphs.
    enforce_eager: bool = False
    routing: str = DEFAULT_POLICY
    # NOTE: hash=False: a dict is unhashable; equal configs still hash equal.
    routing_args: dict[str, Any] = field(default_factory=dict, hash=False)
    undelivered_output_timeout_s: float = 60.0
    placement_timeout_s: float | None = 60.0
    simulation: SimulationConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_dir, str) or not self.model_dir:
            raise ValueError(f"model_dir must be a non-empty path string, got {self.model_dir!r}")
        if not isinstance(self.parallel, ParallelConfig):
            raise ValueError(f"parallel must be a ParallelConfig, got {type(self.parallel).__name__}")
        check_positive_ints(max_num_batched_tokens=self.max_num_batched_tokens)
        check_positive_ints(max_num_seqs=self.max_num_seqs)
        if self.max_model_len is not None:
            check_positive_ints(max_model_len=self.max_model_len)
        if self.long_prefill_token_threshold is not None:
            check_positive_ints(long_prefill_token_threshold=self.long_prefill_token_threshold)
        check_block_size(self.block_size)
        if self.num_blocks is not None:
            check_num_blocks(self.num_blocks)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {self.dtype!r}")
        if self.device is not None and self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be None, 'cpu' or 'cuda', got {self.device!r}")
        if self.cpu_kv_cache_bytes is not None:
            check_positive_ints(cpu_kv_cache_bytes=self.cpu_kv_cache_bytes)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_threads is not None:
            check_positive_ints(cpu_threads=self.cpu_threads)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.routing, str) or self.routing not in POLICIES:
            raise ValueError(f"routing must be one of {sorted(POLICIES)}, got {self.routing!r}")
        if not isinstance(self.routing_args, dict) or not all(isinstance(k, str) for k in self.routing_args):
            raise ValueError(f"routing_args must be a dict of keyword arguments, got {self.routing_args!r}")
        # A copy: the caller may change its dict, the config must not change.
        object.__setattr__(self, "routing_args", dict(self.routing_args))
        # Fail now, not in the actor, on arguments the policy rejects.
        self.routing_policy()
        timeout = self.undelivered_output_timeout_s
        if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"undelivered_output_timeout_s must be a positive number, got {timeout!r}")
        placement = self.placement_timeout_s
        if placement is not None and (
            not isinstance(placement, (int, float)) or not math.isfinite(placement) or placement <= 0
        ):
            raise ValueError(f"placement_timeout_s must be a positive number or None, got {placement!r}")
        if self.simulation is not None:
            if not isinstance(self.simulation, SimulationConfig):
                raise ValueError(f"simulation must be a SimulationConfig, got {type(self.simulation).__name__}")
            if self.num_blocks is None:
                raise ValueError("num_blocks is required with simulation: simulated replicas have no memory to size")
        # Fail now, not in the actor, on combinations SchedulerConfig rejects.
        self.scheduler_config(self.max_model_len or self.max_num_batched_tokens)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The step scheduler's limits, given the model's (resolved) ``max_model_len``."""
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
        )

    def routing_policy(self) -> RoutingPolicy:
        """A fresh policy named ``routing``, built with ``routing_args``.

        A policy that takes ``max_num_batched_tokens`` (``cost_ttft``, which
        prices queued work in steps of that budget) gets this config's step
        budget unless ``routing_args`` sets it.
        """
        kwargs = dict(self.routing_args)
        factory = POLICIES[self.routing]
        if "max_num_batched_tokens" not in kwargs and "max_num_batched_tokens" in inspect.signature(factory).parameters:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        try:
            return make_policy(self.routing, **kwargs)
        except ValueError as exc:
            raise ValueError(f"routing_args: {exc}") from None

    def cache_config(self, num_blocks: int, model_id: str) -> CacheConfig:
        """One replica's block pool, once its workers have reported ``num_blocks``."""
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            model_id=model_id,
        )

    def worker_config(self, max_model_len: int | None = None) -> WorkerConfig | SimulatedWorkerConfig:
        """The rank-0 template of every replica's workers (the launcher sets rank and init method).

        ``max_model_len`` is the resolved one (``ModelConfig.max_model_len``).
        """
        if self.simulation is not None:
            return SimulatedWorkerConfig(
                simulation=self.simulation,
                num_blocks=self.num_blocks,  # type: ignore[arg-type]  # required with simulation
                tp_size=self.parallel.tensor_parallel_size,
            )
        # NOTE: imported here: the worker module pulls in torch, which the
        # front end and `kvserve --help` do not need.
        from kvserve.worker.worker import WorkerConfig

        config = WorkerConfig(
            model_dir=self.model_dir,
            tp_size=self.parallel.tensor_parallel_size,
            device=self.device,
            dtype=self.dtype,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            gpu_memory_utilization=self.gpu_memory_utilization,
            cpu_threads=self.cpu_threads,
            sampler_seed=self.seed,
            max_model_len=max_model_len,
            max_num_seqs=self.max_num_seqs,
            enforce_eager=self.enforce_eager,
        )
        if self.cpu_kv_cache_bytes is not None:
            config = dataclasses.replace(config, cpu_kv_cache_bytes=self.cpu_kv_cache_bytes)
        return config
