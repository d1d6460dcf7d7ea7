"""The CUDA attention backend: cache writes and mixed-batch paged attention in CUDA kernels.

One call of :meth:`CudaAttentionBackend.paged_attention` runs up to three kernels
(``csrc/paged_attention_kernels.cuh``), all reading K/V in place through the block tables:

* decode rows (requests with one new token): split-K over the context, one CTA per
  (request, kv head, split); the query heads of a GQA group share every K/V load;
* prefill rows (chunks, with or without cached context): the same CTA code on tiles of 8
  (token, head) pairs of one kv head, causal within the chunk;
* a combine of the split partials, for rows whose context spans several splits.

Prefill rows go instead to FlashAttention's tensor-core kernel that ships with torch, on
K/V gathered from the cache (:mod:`kvserve.kernels.flash_prefill`), where it can serve
them (bf16/fp16 on compute capability 8.0+); ``flash_prefill=False`` keeps them on the
CUDA-core kernel above.

The attention kernel sums each score over its thread group transposed, each lane then running
the online softmax for the scores it owns only (see ``csrc/NOTES.md``).

Shapes the kernels lack (another head_dim or block size, float64) fall back to the torch
reference, with one warning per shape.  ``KVSERVE_ATTENTION_BACKEND=torch`` forces the
reference everywhere (see :mod:`kvserve.kernels.backend`).
"""

from __future__ import annotations

import logging

import torch

from kvserve.kernels.attention_backend import AttentionBackend
from kvserve.kernels.attention_metadata import AttentionMetadata
from kvserve.kernels.cuda_build import load_cuda_extension
from kvserve.kernels.cuda_plan import SplitPlan, check_split_tokens, plan_splits
from kvserve.kernels.flash_prefill import (
    PrefillPlan,
    flash_varlen_attention,
    flash_varlen_unsupported,
    plan_prefill,
    prefill_attention,
    select_rows,
    write_rows,
)

logger = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNEL_HEAD_DIMS = (64, 128)
KERNEL_BLOCK_SIZES = (16, 32)


class CudaAttentionBackend(AttentionBackend):
    """CUDA kernels for the cache write and for paged attention over mixed batches.

    Construction builds the extension for the current CUDA device on first use on a
    machine (see :mod:`kvserve.kernels.cuda_build`) and raises
    :class:`~kvserve.kernels.cuda_build.CudaExtensionBuildError` when it cannot.
    ``split_tokens`` fixes the context split size (a multiple of 64 up to 8192) instead
    of choosing it per batch; tests and benchmarks use it.
    """

    __slots__ = (
        "_extension", "_num_sms", "_split_tokens", "_flash_prefill", "_flash_unsupported", "_plan_metadata",
        "_plans", "_prefill_plan", "_warned",
    )
    name = "cuda"

    def __init__(self, *, split_tokens: int | None = None, flash_prefill: bool = True) -> None:
        if split_tokens is not None:
            check_split_tokens(split_tokens)
        self._extension = load_cuda_extension()
        self._num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self._split_tokens = split_tokens
        self._flash_prefill = flash_prefill
        # Why FlashAttention cannot serve each (dtype, head_dim, device) of query, None where it can.
        self._flash_unsupported: dict[tuple[torch.dtype, int, torch.device], str | None] = {}
        # The plans depend only on the batch: computed at the first layer of a step, reused by the others.
        self._plan_metadata: AttentionMetadata | None = None
        self._plans: dict[tuple[int, int, int, bool], SplitPlan] = {}
        self._prefill_plan: PrefillPlan | None = None
        self._warned: set[str] = set()

    def cannot_write(
        self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> str | None:
        dtype = key_cache.dtype
        if not (key_cache.is_cuda and dtype in KERNEL_DTYPES and key.dtype == value.dtype == value_cache.dtype == dtype):
            return f"no cache write of {key.dtype} rows into a {dtype} cache on {key_cache.device}"
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            return "the KV cache is not contiguous"
        if key_cache.shape[-1] * key_cache.element_size() % 16:
            return "a head's row is not a multiple of 16 bytes"
        return None

    def cannot_attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> str | None:
        return _unsupported(query, key_cache, value_cache)

    def _falls_back(self, reason: str) -> None:
        self._warn_once(f"{reason}; using the slower torch reference for these calls")

    def _write(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self._extension.write_kv_cache(
            _vector_ready(key), _vector_ready(value), key_cache, value_cache, _index_tensor(slot_mapping, torch.int64)
        )

    def _attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if metadata.num_tokens == 0:
            return torch.empty(query.shape, dtype=query.dtype, device=query.device)
        num_kv_heads = key_cache.shape[2]
        prefill = self._flash_prefill_plan(query, key_cache, metadata)
        if prefill is not None:
            try:
                flash_output = prefill_attention(query, key_cache, value_cache, prefill, scale, flash_varlen_attention)
            except RuntimeError as exc:  # a torch whose FlashAttention refuses these shapes: keep serving
                self._flash_prefill = False
                self._prefill_plan = None
                self._warn_once(f"FlashAttention failed ({exc}); prefill rows stay on the CUDA-core kernel")
                return self._attend(query, key_cache, value_cache, metadata, scale)
            if prefill.covers_batch(metadata.num_tokens):
                return flash_output  # every row is a prefill row: no copy into a second output
            output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
            decode_metadata = prefill.decode_metadata
            if decode_metadata is not None:  # the decode rows, as a batch of their own
                plan = self.split_plan(metadata, num_kv_heads, query.shape[1] // num_kv_heads, query.shape[2],
                                       decode_only=True)
                decode_query = select_rows(query, prefill.decode_token_indices)
                decode_output = torch.empty(decode_query.shape, dtype=query.dtype, device=query.device)
                self._launch(decode_output, decode_query, key_cache, value_cache, decode_metadata, scale, plan)
                write_rows(output, prefill.decode_token_indices, decode_output)
            write_rows(output, prefill.token_indices, flash_output)
            return output
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        plan = self.split_plan(metadata, num_kv_heads, query.shape[1] // num_kv_heads, query.shape[2])
        self._launch(output, query, key_cache, value_cache, metadata, scale, plan)
        return output

    def _launch(
        self,
        output: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        plan: SplitPlan,
    ) -> None:
        self._extension.paged_attention(
            output,
            _vector_ready(query),
            key_cache,
            value_cache,
            _index_tensor(metadata.block_tables, torch.int32),
            _index_tensor(metadata.seq_lens, torch.int32),
            _index_tensor(metadata.query_start_loc, torch.int32),
            float(scale),
            plan.split_tokens,
            plan.num_decode_splits,
            plan.num_prefill_splits,
            # A captured launch is planned for the longest contexts it may replay; its
            # split count then cuts each request's real context evenly (the kernels'
            # split_tokens_of), so a short context still fills as many CTAs.
            metadata.captured,
        )

    def split_plan(
        self, metadata: AttentionMetadata, num_kv_heads: int, group: int, head_dim: int, *, decode_only: bool = False
    ) -> SplitPlan:
        """The split plan of ``metadata``'s batch (see :mod:`kvserve.kernels.cuda_plan`), cached per batch.

        ``decode_only``: for its decode rows alone (FlashAttention serves the prefill rows).
        """
        self._forget_other_batch(metadata)
        key = (num_kv_heads, group, head_dim, decode_only)
        plan = self._plans.get(key)
        if plan is None:
            if decode_only:  # the decode rows' own batch, which _flash_prefill_plan made
                assert self._prefill_plan is not None and self._prefill_plan.decode_metadata is not None
                source = self._prefill_plan.decode_metadata
            else:
                source = metadata
            plan = plan_splits(
                source.query_start_loc_cpu, source.seq_lens_cpu, num_kv_heads, group, self._num_sms,
                self._split_tokens, head_dim=head_dim,
            )
            self._plans[key] = plan
        return plan

    def _flash_prefill_plan(
        self, query: torch.Tensor, key_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> PrefillPlan | None:
        """The batch's prefill plan when FlashAttention serves its prefill rows, else ``None``."""
        if not self._flash_prefill or metadata.max_query_len <= 1:
            return None
        # NOTE: checked once per kind of query, not at every layer (it asks the device).
        kind = (query.dtype, query.shape[-1], query.device)
        if kind not in self._flash_unsupported:
            self._flash_unsupported[kind] = flash_varlen_unsupported(query)
        unsupported = self._flash_unsupported[kind]
        if unsupported is not None:
            self._warn_once(f"prefill rows stay on the CUDA-core kernel: {unsupported}")
            return None
        self._forget_other_batch(metadata)
        if self._prefill_plan is None:
            self._prefill_plan = plan_prefill(metadata, key_cache.shape[1])
        return self._prefill_plan

    def _forget_other_batch(self, metadata: AttentionMetadata) -> None:
        if metadata is not self._plan_metadata:
            self._plan_metadata = metadata
            self._plans.clear()
            self._prefill_plan = None

    def _warn_once(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning("CUDA attention kernels: %s", reason)

    def __repr__(self) -> str:
        return f"CudaAttentionBackend(split_tokens={self._split_tokens}, flash_prefill={self._flash_prefill})"


def _unsupported(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> str | None:
    """Why the kernels cannot run these inputs, or ``None`` when they can."""
    _, block_size, _, head_dim = key_cache.shape
    if not (query.is_cuda and key_cache.is_cuda and value_cache.is_cuda):
        return "tensors are not on a CUDA device"
    if query.dtype not in KERNEL_DTYPES or key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        return f"no kernel for dtype {query.dtype} with a {key_cache.dtype} cache"
    if head_dim not in KERNEL_HEAD_DIMS:
        return f"no kernel for head_dim {head_dim} (supported: {KERNEL_HEAD_DIMS})"
    if block_size not in KERNEL_BLOCK_SIZES:
        return f"no kernel for block_size {block_size} (supported: {KERNEL_BLOCK_SIZES})"
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return "the KV cache is not contiguous"
    if key_cache.data_ptr() % 16 or value_cache.data_ptr() % 16:
        return "the KV cache does not start on a 16-byte boundary"
    return None


def _index_tensor(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as the kernels read it: ``dtype``, contiguous (``build_attention_metadata``'s already are).

    The torch reference takes any integer tensor, so a hand-built batch with int64 block
    tables works there; here it is converted rather than refused.
    """
    if tensor.dtype == dtype and tensor.is_contiguous():
        return tensor
    return tensor.to(dtype).contiguous()


def _vector_ready(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when the kernels can read it 16 bytes at a time, else a contiguous copy.

    Views of a fused QKV projection (row stride (H + 2 * KVH) * head_dim) qualify as they are.
    """
    elems_per_vector = 16 // tensor.element_size()
    if (
        tensor.stride(-1) == 1
        and all(stride % elems_per_vector == 0 for stride in tensor.stride()[:-1])
        and tensor.data_ptr() % 16 == 0
    ):
        return tensor
    # NOTE: not .contiguous(), which returns the tensor itself when only a dimension of
    # size 1 has an odd stride; the kernels check every stride.
    return tensor.clone(memory_format=torch.contiguous_format)
