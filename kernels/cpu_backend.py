"""The CPU attention backend: attention and cache writes through fused C++ kernels.

The reference path gathers every request's K/V into a padded copy before
attending; on CPU that copy costs more than the attention itself.  The C++
kernels (``csrc/paged_attention_cpu.cpp``) read K/V in place through the block
tables, and read and write the rows of query and output in place, so a layer
costs one call whatever the mix of its batch:

* decode rows: per request, its GQA group of query heads together (AVX2 or
  portable code);
* prefill chunks and cascades (decode requests over a shared cached prefix): row
  tiles of 16 query rows in vector lanes (AVX-512, or AVX2).  On a CPU without
  AVX2 the kernel says so and prefill chunks take the reference path (SDPA).

The cache write is one C++ call too: it copies rows, where ``index_copy_`` on the
reference path costs two dispatches and two casts.
"""

from __future__ import annotations

import torch

from kvserve.kernels import reference
from kvserve.kernels.attention_backend import AttentionBackend
from kvserve.kernels.attention_metadata import AttentionMetadata
from kvserve.kernels.cpu_build import load_cpu_extension

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CpuAttentionBackend(AttentionBackend):
    """C++ cache writes and attention, one call each per layer.

    Construction compiles the extension on first use on a machine (see
    :mod:`kvserve.kernels.cpu_build`) and raises
    :class:`~kvserve.kernels.cpu_build.CpuExtensionBuildError` when it cannot.
    Tensors must be on the CPU and the caches contiguous; query, key and value
    rows may be views of a fused projection (heads and dims dense).  A dtype the
    kernels lack (float64), or a query whose dtype is not the caches', takes
    the reference path throughout.
    """

    __slots__ = ("_extension",)
    name = "cpu"

    def __init__(self) -> None:
        self._extension = load_cpu_extension()

    def cannot_write(
        self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> str | None:
        if key.dtype == value.dtype == key_cache.dtype == value_cache.dtype and key.dtype in KERNEL_DTYPES:
            return None
        return f"no kernel for {key.dtype} rows into a {key_cache.dtype} cache"

    def cannot_attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> str | None:
        # The kernel reads one dtype throughout (as for the cache write, the reference takes the rest).
        if query.dtype == key_cache.dtype == value_cache.dtype and query.dtype in KERNEL_DTYPES:
            return None
        return f"no kernel for a {query.dtype} query over a {key_cache.dtype} cache"

    def _write(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self._extension.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)

    def _attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        # Every row in one call; without AVX2 the prefill chunks are left to the reference.
        prefill_done = self._extension.paged_attention(
            output, query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens, float(scale),
            query_start_loc=None if metadata.max_query_len == 1 else metadata.query_start_loc,
        )
        if not prefill_done:
            _, prefill_reqs = reference.split_decode_and_prefill(metadata)
            reference.prefill_attention(query, key_cache, value_cache, metadata, scale, prefill_reqs, output)
        return output

    def __repr__(self) -> str:
        return "CpuAttentionBackend()"
