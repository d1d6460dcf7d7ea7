"""The engine's settings: one tree of frozen dataclasses, each field defined, documented
and validated once.

``EngineConfig`` is what ``LLM(model, **kwargs)`` runs and what every replica of a
cluster runs (``ClusterConfig.engine``); its groups:

* ``cache``: the paged KV cache of a replica (``CacheSettings``);
* ``scheduler``: the step scheduler's limits (``SchedulerSettings``);
* ``runtime``: how the model runs on its device (``RuntimeSettings``);
* ``parallel``: replicas and tensor-parallel ranks (``ParallelConfig``).

Field names are unique across the groups, so a flat set of keyword arguments maps
onto the tree (``EngineConfig.from_kwargs``); ``LLM``'s keywords and ``kvserve
serve``'s flags are those names.  What only a running engine knows (the model's own
``max_model_len``, how many blocks fit the device, the model id mixed into block
hashes) is resolved into ``SchedulerConfig`` and ``CacheConfig`` by
``EngineConfig.scheduler_config`` and ``EngineConfig.cache_config``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvserve.scheduler.checks import (
    check_block_size,
    check_num_blocks,
    check_positive_ints,
    check_tenant_cache_share,
)
from kvserve.scheduler.config import CacheConfig, SchedulerConfig
from kvserve.scheduler.sampling_params import MAX_SEED, MIN_SEED

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("cpu", "cuda")
ATTENTION_BACKENDS = ("torch", "cpu", "cuda")


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """The paged KV cache of each replica.

    ``num_blocks`` counts the null block; ``None`` sizes the cache to the device: the
    share ``gpu_memory_utilization`` of a GPU's memory less what is in use, or
    ``cpu_kv_cache_bytes`` on a CPU (``None``: the worker's default, 512 MiB).
    ``tenant_cache_share`` F: while a tenant's (an authenticated caller's) cached blocks hold
    more than F of the usable blocks, the other tenants' cached blocks are evicted last, so
    that it cannot evict the others' prefixes (``kvserve.scheduler.tenant_block_pool``;
    ``None``: one LRU order for all).
    """

    block_size: int = 16
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int | None = None
    tenant_cache_share: float | None = None

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        check_tenant_cache_share(self.tenant_cache_share)
        if self.num_blocks is not None:
            check_num_blocks(self.num_blocks)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0.0 < utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
        if self.cpu_kv_cache_bytes is not None:
            check_positive_ints(cpu_kv_cache_bytes=self.cpu_kv_cache_bytes)


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    """The step scheduler's limits (``SchedulerConfig`` once ``max_model_len`` is resolved:
    ``None`` is the model's own limit)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None

    def __post_init__(self) -> None:
        if self.max_model_len is not None:
            check_positive_ints(max_model_len=self.max_model_len)
        # SchedulerConfig holds the checks of the fields and of their combinations.
        self.resolve(self.max_model_len or self.max_num_batched_tokens)

    def resolve(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's config, given the model's resolved ``max_model_len``."""
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
        )


@dataclass(frozen=True, slots=True)
class RuntimeSettings:
    """How the model runs: ``device`` ``None`` is ``cuda`` where there is one, else ``cpu``;
    ``dtype`` ``"auto"`` is bfloat16 on CUDA and float32 on CPU; ``seed`` seeds the
    sampler of requests without their own (``None``: a random seed); ``enforce_eager``
    runs CUDA decode steps without graphs; ``async_scheduling`` plans each step while
    the workers run the one before (overlapped scheduling, ``EngineCore``; ``None``: on
    where the step runs on a GPU or in other processes, off for one CPU rank in process);
    ``attention_backend`` ``None`` picks the
    device's kernels; ``cpu_threads`` are each CPU rank's torch threads (``None``: the
    cores divided among a replica's ranks)."""

    device: str | None = None
    dtype: str = "auto"
    seed: int | None = 0
    enforce_eager: bool = False
    async_scheduling: bool | None = None
    attention_backend: str | None = None
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        if self.device is not None and self.device not in DEVICES:
            raise ValueError(f"device must be None or one of {list(DEVICES)}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            # NOTE: the sampler keeps a seed's low 64 bits: 2**64 sampled as 0 did.
            raise ValueError(f"seed must be a 64-bit signed integer ({MIN_SEED} to {MAX_SEED}) or None, got {self.seed}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool or None (auto), got {self.async_scheduling!r}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be None or one of {list(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        if self.cpu_threads is not None:
            check_positive_ints(cpu_threads=self.cpu_threads)


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How many copies of the model (replicas) and how many ranks each (tensor parallel)."""

    tensor_parallel_size: int = 1
    num_replicas: int = 1

    def __post_init__(self) -> None:
        check_positive_ints(tensor_parallel_size=self.tensor_parallel_size, num_replicas=self.num_replicas)

    @property
    def num_workers(self) -> int:
        return self.tensor_parallel_size * self.num_replicas


_GROUPS = {"cache": CacheSettings, "scheduler": SchedulerSettings, "runtime": RuntimeSettings, "parallel": ParallelConfig}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """A model (a Hugging Face directory) and how to serve it: see the module docstring."""

    model: str
    cache: CacheSettings = field(default_factory=CacheSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty path string, got {self.model!r}")
        for name, group in _GROUPS.items():
            value = getattr(self, name)
            if not isinstance(value, group):
                raise ValueError(f"{name} must be a {group.__name__}, got {type(value).__name__}")

    @staticmethod
    def field_group(name: str) -> str | None:
        """The group that defines setting ``name`` (``"cache"``, ...), ``None`` if none does."""
        return _FIELD_GROUPS.get(name)

    @staticmethod
    def default(name: str) -> Any:
        """The default value of setting ``name``; ``KeyError`` if no group defines it."""
        group = _GROUPS[_FIELD_GROUPS[name]]
        (spec,) = [f for f in dataclasses.fields(group) if f.name == name]
        return spec.default

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Every setting's name, in the groups' order."""
        return tuple(_FIELD_GROUPS)

    @classmethod
    def from_kwargs(cls, model: str, **settings: Any) -> EngineConfig:
        """The config whose settings are ``settings`` (flat names, e.g. ``block_size=32``, or a
        whole group by its name, e.g. ``parallel=ParallelConfig(...)``), defaults elsewhere;
        ``TypeError`` for a name no group defines, ``ValueError`` for a bad value (naming the
        setting)."""
        grouped: dict[str, dict[str, Any]] = {name: {} for name in _GROUPS}
        whole = {name: settings.pop(name) for name in list(settings) if name in _GROUPS}
        for name, value in settings.items():
            group = _FIELD_GROUPS.get(name)
            if group is None:
                raise TypeError(f"unexpected setting {name!r}; the settings are: {', '.join(_FIELD_GROUPS)}")
            if group in whole:
                raise TypeError(f"{name} is set both by name and in the {group} group")
            grouped[group][name] = value
        return cls(model, **{name: whole.get(name) or group(**grouped[name]) for name, group in _GROUPS.items()})

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The step scheduler's limits, given the model's resolved ``max_model_len``."""
        return self.scheduler.resolve(max_model_len)

    def cache_config(self, num_blocks: int, model_id: str) -> CacheConfig:
        """One replica's block pool, once its workers have reported ``num_blocks``."""
        return CacheConfig(
            block_size=self.cache.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=self.cache.enable_prefix_caching,
            model_id=model_id,
            tenant_cache_share=self.cache.tenant_cache_share,
        )


_FIELD_GROUPS = {
    f.name: group_name for group_name, group in _GROUPS.items() for f in dataclasses.fields(group)
}
assert len(_FIELD_GROUPS) == sum(len(dataclasses.fields(g)) for g in _GROUPS.values()), "setting names must be unique"
