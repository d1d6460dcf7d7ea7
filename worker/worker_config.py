"""How to start one rank of a replica (:class:`WorkerConfig`), without torch.

Its own module so that the scheduler actor, which builds a replica's worker configs
and sends them to the worker actors, imports neither torch nor transformers (about
2 s and 200 MB a process); :mod:`kvserve.worker.worker` runs them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvserve.scheduler.checks import check_block_size, check_num_blocks
from kvserve.scheduler.engine_config import EngineConfig

# The dtypes a worker can run in (its torch dtypes: kvserve.worker.worker.resolve_dtype).
DTYPE_NAMES = ("float32", "float16", "bfloat16")
DEFAULT_CPU_KV_CACHE_BYTES = 512 * 2**20


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """How to start one rank.

    ``device`` ``None`` picks ``cuda`` when available, else ``cpu``.
    ``dtype`` ``"auto"`` is float32 on CPU and bfloat16 on CUDA.  The cache
    size is ``num_blocks`` when given; otherwise derived from
    ``gpu_memory_utilization`` on CUDA or ``cpu_kv_cache_bytes`` on CPU.
    """

    model_dir: str
    rank: int = 0
    tp_size: int = 1
    device: str | None = None
    dtype: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = DEFAULT_CPU_KV_CACHE_BYTES
    distributed_init_method: str | None = None
    attention_backend: str | None = None
    sampler_seed: int | None = None
    # CPU only: torch threads for this rank (None: the cores divided among the ranks).
    cpu_threads: int | None = None
    # The longest sequence the scheduler sends (None: the model's max_position_embeddings).
    max_model_len: int | None = None
    # The most requests in one step (the scheduler's max_num_seqs): the largest CUDA graph.
    max_num_seqs: int = 256
    # CUDA only: run every step eagerly instead of replaying CUDA graphs for decode steps.
    enforce_eager: bool = False

    @classmethod
    def for_engine(cls, engine: EngineConfig, max_model_len: int | None = None) -> WorkerConfig:
        """Rank 0's config for a replica of ``engine`` (a launcher sets the rank and the
        rendezvous of the others); ``max_model_len`` is the resolved one."""
        cache, runtime = engine.cache, engine.runtime
        config = cls(
            model_dir=engine.model,
            tp_size=engine.parallel.tensor_parallel_size,
            device=runtime.device,
            dtype=runtime.dtype,
            block_size=cache.block_size,
            num_blocks=cache.num_blocks,
            gpu_memory_utilization=cache.gpu_memory_utilization,
            attention_backend=runtime.attention_backend,
            sampler_seed=runtime.seed,
            cpu_threads=runtime.cpu_threads,
            max_model_len=max_model_len,
            max_num_seqs=engine.scheduler.max_num_seqs,
            enforce_eager=runtime.enforce_eager,
        )
        if cache.cpu_kv_cache_bytes is not None:
            config = dataclasses.replace(config, cpu_kv_cache_bytes=cache.cpu_kv_cache_bytes)
        return config

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank must be in [0, {self.tp_size}), got {self.rank}")
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        check_block_size(self.block_size)
        if self.num_blocks is not None:
            check_num_blocks(self.num_blocks)
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
