"""One rank of one replica: model shard, paged KV cache, and step execution.

No Ray and no gRPC here: the cluster wraps a ``Worker`` in an actor, the
in-process engine uses it directly.  Lifecycle::

    worker = Worker(config)                 # device, torch.distributed, weights
    num_blocks = worker.determine_num_blocks()
    worker.initialize_cache(min over ranks of num_blocks)
    result = worker.execute(plan)           # every step; rank 0 returns samples
    worker.shutdown()
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from transformers import AutoConfig

from kvserve.kernels import get_attention_backend
from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult
from kvserve.worker.distributed import TensorParallelGroup, init_distributed
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.kv_cache import (
    KVCacheSpec,
    allocate_kv_cache,
    cuda_kv_cache_budget,
    num_blocks_for_budget,
)
from kvserve.worker.model_loader import load_model
from kvserve.worker.sampler import Sampler
from kvserve.worker.tiny_model import ensure_default_tiny_model_at

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
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

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank must be in [0, {self.tp_size}), got {self.rank}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


def resolve_device(config: WorkerConfig) -> torch.device:
    """The worker's device: ``config.device``, else a GPU when there is one; a GPU always by index.

    ``"cuda"`` without an index means the rank's GPU among those visible (one per Ray
    actor, which sees only its own).  NOTE: ``torch.cuda.set_device`` refuses a CUDA
    device without an index (torch 2.11: "Expected a torch.device with a specified index").
    """
    if config.device is not None:
        device = torch.device(config.device)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" or device.index is not None:
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device {config.device!r} was asked for, but no CUDA device is visible")
    return torch.device("cuda", config.rank % torch.cuda.device_count())


def resolve_dtype(config: WorkerConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class Worker:
    """Holds one rank's model shard and KV cache and executes step plans."""

    def __init__(self, config: WorkerConfig) -> None:
        if config.tp_size > 1 and not config.distributed_init_method:
            raise ValueError("distributed_init_method is required when tp_size > 1")
        self.config = config
        self.device = resolve_device(config)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        elif config.cpu_threads is not None or config.tp_size > 1:
            # NOTE: ranks of one replica share the host's cores; oversubscribed
            # OpenMP threads spin against each other and slow a step tenfold.
            torch.set_num_threads(config.cpu_threads or max(1, (os.cpu_count() or 1) // config.tp_size))
        self.dtype = resolve_dtype(config, self.device)
        self.tp: TensorParallelGroup = init_distributed(
            config.rank, config.tp_size, config.distributed_init_method or ""
        )
        ensure_default_tiny_model_at(config.model_dir)
        self.hf_config = AutoConfig.from_pretrained(config.model_dir)
        backend = get_attention_backend(self.device, config.attention_backend)
        self.model = load_model(
            config.model_dir, self.tp, dtype=self.dtype, device=self.device, attention_backend=backend,
            max_model_len=config.max_model_len,
        )
        self.sampler = Sampler(seed=config.sampler_seed)
        self.input_batch = InputBatch(config.block_size, self.device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and returns tokens."""
        return self.config.rank == 0

    def kv_cache_spec(self) -> KVCacheSpec:
        hf = self.hf_config
        num_heads = hf.num_attention_heads
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        return KVCacheSpec(
            num_layers=hf.num_hidden_layers,
            block_size=self.config.block_size,
            num_local_kv_heads=max(1, num_kv_heads // self.config.tp_size),
            head_dim=head_dim,
            dtype=self.dtype,
        )

    def determine_num_blocks(self) -> int:
        """Blocks this rank can hold; the replica uses the minimum over its ranks."""
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        spec = self.kv_cache_spec()
        if self.device.type == "cuda":
            budget = cuda_kv_cache_budget(self.device, self.config.gpu_memory_utilization)
        else:
            budget = self.config.cpu_kv_cache_bytes
        return num_blocks_for_budget(spec, budget)

    def initialize_cache(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {num_blocks}")
        self.kv_caches = allocate_kv_cache(self.kv_cache_spec(), num_blocks, self.device)
        self.num_blocks = num_blocks

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult | None:
        """Run ``plan``; rank 0 returns the sampled tokens, other ranks ``None``."""
        if not self.kv_caches:
            raise RuntimeError("initialize_cache() must be called before execute()")
        batch = self.input_batch
        batch.apply(plan)
        if not plan.req_ids:
            return StepResult(plan.step_id) if self.is_driver else None
        inputs = batch.prepare(plan)
        hidden_states = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
        if not inputs.output_indices:
            return StepResult(plan.step_id) if self.is_driver else None
        logits = self.model.compute_logits(hidden_states[inputs.logits_indices])
        if not self.is_driver:
            return None
        sampled = self.sampler(logits, inputs.sampling_params, inputs.output_indices)
        return StepResult(plan.step_id, sampled.token_ids.tolist(), sampled.logprobs.tolist())

    def shutdown(self) -> None:
        self.kv_caches = []
        if self.config.tp_size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
