"""The CPU attention backend: decode rows through a fused C++ kernel.

The reference decode path gathers every decode request's K/V into a padded
copy before attending; on CPU that copy costs more than the attention itself.
The C++ kernel (``csrc/paged_attention_cpu.cpp``) reads K/V in place through
the block tables instead.  Prefill chunks, which attend many query tokens to
the same context, keep the reference path (SDPA amortises its gather), and so
does the cache write.
"""

from __future__ import annotations

import torch

from kvserve.kernels import reference
from kvserve.kernels.attention_metadata import AttentionMetadata
from kvserve.kernels.cpu_build import load_cpu_extension

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CpuAttentionBackend:
    """Reference cache writes and prefill; decode attention in one C++ call per batch.

    Construction compiles the extension on first use on a machine (see
    :mod:`kvserve.kernels.cpu_build`) and raises
    :class:`~kvserve.kernels.cpu_build.CpuExtensionBuildError` when it cannot.
    Tensors must be on the CPU and the caches contiguous; decode rows of a
    dtype the kernel lacks (float64) fall back to the reference.
    """

    __slots__ = ("_extension",)
    name = "cpu"

    def __init__(self) -> None:
        self._extension = load_cpu_extension()

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        reference.check_shapes(query, key_cache, value_cache, metadata)
        output = torch.empty_like(query)
        decode_reqs, prefill_reqs = reference.split_decode_and_prefill(metadata)
        if decode_reqs:
            decode = self._decode_attention if query.dtype in KERNEL_DTYPES else reference.decode_attention
            decode(query, key_cache, value_cache, metadata, scale, decode_reqs, output)
        reference.prefill_attention(query, key_cache, value_cache, metadata, scale, prefill_reqs, output)
        return output

    def _decode_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        decode_reqs: list[int],
        output: torch.Tensor,
    ) -> None:
        """All decode rows in one kernel call, on views where the rows are one contiguous run."""
        token_indices = [metadata.query_start_loc_cpu[r] for r in decode_reqs]
        queries = reference.select_rows(query, token_indices).contiguous()
        attended = torch.empty_like(queries)
        self._extension.paged_decode_attention(
            attended,
            queries,
            key_cache,
            value_cache,
            reference.select_rows(metadata.block_tables, decode_reqs).contiguous(),
            reference.select_rows(metadata.seq_lens, decode_reqs).contiguous(),
            float(scale),
        )
        reference.write_rows(output, token_indices, attended)

    def __repr__(self) -> str:
        return "CpuAttentionBackend()"
