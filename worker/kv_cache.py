"""The paged KV cache of one worker: per layer, K and V blocks of its KV-head shard.

::

    key_cache[layer]  : [num_blocks, block_size, num_local_kv_heads, head_dim]
    value_cache[layer]: [num_blocks, block_size, num_local_kv_heads, head_dim]

Block ids are shared by every rank of a replica; block 0 is the null block.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from kvserve.scheduler.checks import SettingError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape of one rank's cache, independent of how many blocks it has."""

    num_layers: int
    block_size: int
    num_local_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_local_kv_heads * self.head_dim * element_size


def num_blocks_for_budget(spec: KVCacheSpec, budget_bytes: int, setting: str) -> int:
    """How many blocks (null block included) fit in ``budget_bytes``, which ``setting`` gave (its
    name and value: "cpu_kv_cache_bytes is 1"); ``SettingError`` if fewer than 2."""
    num_blocks = budget_bytes // spec.bytes_per_block
    if num_blocks < 2:
        raise SettingError(
            f"{setting}: this rank's KV cache gets {budget_bytes} bytes, {num_blocks} blocks of "
            f"{spec.bytes_per_block} bytes; at least 2 blocks ({2 * spec.bytes_per_block} bytes) are needed"
        )
    return int(num_blocks)


def cuda_kv_cache_budget(device: torch.device, gpu_memory_utilization: float) -> int:
    """Bytes left for the cache on ``device`` once weights are loaded.

    The worker may use ``gpu_memory_utilization`` of the device's memory in
    all; what is already allocated (weights, the framework's own) comes off it.
    Memory this process freed but torch's caching allocator still holds (an
    ``LLM`` dropped without ``shutdown()``) is returned to the device first.
    """
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    budget = int(total * gpu_memory_utilization) - used
    if budget <= 0:
        raise SettingError(
            f"no memory left for the KV cache: {used / 2**30:.1f} GiB of {total / 2**30:.1f} GiB "
            f"are in use, above gpu_memory_utilization ({gpu_memory_utilization})"
        )
    return budget


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed (K, V) cache tensors for every layer."""
    shape = (num_blocks, spec.block_size, spec.num_local_kv_heads, spec.head_dim)
    caches = [
        (torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
        for _ in range(spec.num_layers)
    ]
    logger.info(
        "allocated %d KV blocks (%.1f MiB) on %s", num_blocks, num_blocks * spec.bytes_per_block / 2**20, device
    )
    return caches
