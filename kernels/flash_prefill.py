"""Prefill and chunked-prefill attention on tensor cores, over the paged cache.

The requests of a batch with several new tokens (prompts, chunks of prompts over
cached context) are handed to FlashAttention's variable-length kernel, which
ships with torch (``aten::_flash_attention_forward``, the kernel behind SDPA's
flash backend): their K/V, new tokens already written to the cache, are first
gathered from the cache blocks into one contiguous run per request::

    prefill request r: chunk of q_r new tokens over c_r cached ones, seq_len L_r = c_r + q_r
    q      [sum q_r, heads, d]      rows of the batch's query (token_indices)
    k, v   [sum L_r, kv_heads, d]   cache slots block_tables[r][p // B] * B + p % B, p < L_r
    causal mask aligned to the bottom right: new token j of r sees positions <= c_r + j

FlashAttention (2.1 and later) aligns a causal mask to the bottom right when a
sequence has more keys than queries, which is exactly a chunk over its cached
context; it serves GQA without repeating K/V heads.  The gather reads and writes
each context token's K/V once (4 KB per token for 8 KV heads x 128 in bf16), a
small cost beside the attention's arithmetic.  Decode rows stay with the CUDA
decode kernel.  Why this and not a kernel of our own: ``csrc/NOTES.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.kernels.attention_metadata import AttentionMetadata
from kvserve.kernels.host_to_device import to_device

# (q, k, v, cu_seqlens_q, cu_seqlens_k, max_query_len, max_seq_len, scale) -> out [sum q_r, heads, d]
VarlenAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, float], torch.Tensor
]


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """Where a batch's prefill requests are, and the cache slots of their contexts."""

    # The batch rows of the prefill tokens: a slice when they are one run, else an index tensor.
    token_indices: slice | torch.Tensor
    cu_seqlens_q: torch.Tensor  # int32 [num_prefills + 1]
    cu_seqlens_k: torch.Tensor  # int32 [num_prefills + 1]
    max_query_len: int
    max_seq_len: int
    kv_slots: torch.Tensor  # int64 [sum seq_len], each prefill's context in order
    # The batch's decode requests (one new token) as a batch of their own, for the decode
    # kernel, and the batch rows of their tokens; None when there is none.
    decode_metadata: AttentionMetadata | None
    decode_token_indices: slice | torch.Tensor | None

    def covers_batch(self, num_tokens: int) -> bool:
        """Whether the prefill tokens are all ``num_tokens`` rows of the batch, in order (no decode rows)."""
        rows = self.token_indices
        return self.decode_metadata is None and isinstance(rows, slice) and rows.start == 0 and rows.stop == num_tokens


def plan_prefill(metadata: AttentionMetadata, block_size: int) -> PrefillPlan | None:
    """The prefill plan of ``metadata``'s batch, or ``None`` when it has no prefill request.

    Host work on the metadata's ``*_cpu`` tuples; the slots are computed on the device
    from its block tables, so nothing waits for the device.
    """
    query_start_loc = np.asarray(metadata.query_start_loc_cpu, dtype=np.int64)
    seq_lens = np.asarray(metadata.seq_lens_cpu, dtype=np.int64)
    query_lens = np.diff(query_start_loc)
    prefills = np.flatnonzero(query_lens > 1)
    if prefills.size == 0:
        return None
    decodes = np.flatnonzero(query_lens == 1)
    prefill_query_lens = query_lens[prefills]
    prefill_seq_lens = seq_lens[prefills]
    starts = query_start_loc[prefills]
    tokens = np.repeat(starts - (np.cumsum(prefill_query_lens) - prefill_query_lens), prefill_query_lens)
    tokens += np.arange(int(prefill_query_lens.sum()))
    device = metadata.block_tables.device
    token_indices = _rows(tokens, device)
    total_keys = int(prefill_seq_lens.sum())
    key_requests = np.repeat(prefills, prefill_seq_lens)
    key_positions = np.arange(total_keys) - np.repeat(np.cumsum(prefill_seq_lens) - prefill_seq_lens, prefill_seq_lens)
    requests_and_positions = to_device(np.stack([key_requests, key_positions]), device)
    positions = requests_and_positions[1]
    block_ids = metadata.block_tables[requests_and_positions[0], positions // block_size].to(torch.int64)
    return PrefillPlan(
        token_indices=token_indices,
        cu_seqlens_q=to_device(_cumulative(prefill_query_lens), device),
        cu_seqlens_k=to_device(_cumulative(prefill_seq_lens), device),
        max_query_len=int(prefill_query_lens.max()),
        max_seq_len=int(prefill_seq_lens.max()),
        kv_slots=block_ids * block_size + positions % block_size,
        decode_metadata=_decode_metadata(metadata, decodes, query_start_loc[decodes], seq_lens[decodes])
        if decodes.size else None,
        decode_token_indices=_rows(query_start_loc[decodes], device) if decodes.size else None,
    )


def _decode_metadata(
    metadata: AttentionMetadata, decodes: np.ndarray, tokens: np.ndarray, seq_lens: np.ndarray
) -> AttentionMetadata:
    """The decode requests ``decodes`` (whose tokens are batch rows ``tokens``) of ``metadata``'s
    batch as a batch of their own."""
    device = metadata.block_tables.device
    requests_and_tokens = to_device(np.stack([decodes, tokens]).astype(np.int64), device)
    num_decodes = int(decodes.size)
    return AttentionMetadata(
        query_start_loc=to_device(np.arange(num_decodes + 1, dtype=np.int32), device),
        seq_lens=metadata.seq_lens.index_select(0, requests_and_tokens[0]),
        block_tables=metadata.block_tables.index_select(0, requests_and_tokens[0]),
        slot_mapping=metadata.slot_mapping.index_select(0, requests_and_tokens[1]),
        query_start_loc_cpu=tuple(range(num_decodes + 1)),
        seq_lens_cpu=tuple(seq_lens.tolist()),
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
    )


def _rows(indices: np.ndarray, device: torch.device) -> slice | torch.Tensor:
    """Batch rows ``indices`` (ascending): a slice when they are one run, else an index tensor."""
    if indices[-1] - indices[0] + 1 == indices.size:
        return slice(int(indices[0]), int(indices[-1]) + 1)
    return to_device(indices.astype(np.int64), device)


def prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    attend: VarlenAttention,
) -> torch.Tensor:
    """Attention of the prefill tokens of ``plan``: ``[num prefill tokens, heads, head_dim]``."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    q = select_rows(query, plan.token_indices)
    k = key_cache.view(-1, num_kv_heads, head_dim).index_select(0, plan.kv_slots)
    v = value_cache.view(-1, num_kv_heads, head_dim).index_select(0, plan.kv_slots)
    return attend(
        q.contiguous(), k, v, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_query_len, plan.max_seq_len, scale
    )


def select_rows(tensor: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """``tensor``'s batch rows ``rows`` (a plan's slice or index tensor)."""
    return tensor[rows] if isinstance(rows, slice) else tensor.index_select(0, rows)


def write_rows(tensor: torch.Tensor, rows: slice | torch.Tensor, values: torch.Tensor) -> None:
    """``tensor[rows] = values``, in place, for a plan's slice or index tensor."""
    if isinstance(rows, slice):
        tensor[rows] = values
    else:
        tensor.index_copy_(0, rows, values)


def flash_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """FlashAttention's causal variable-length forward (bottom-right aligned), as torch ships it."""
    output = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_query_len, max_seq_len, 0.0, True, False, scale=scale
    )[0]
    return output


def flash_varlen_unsupported(query: torch.Tensor) -> str | None:
    """Why torch's flash kernel cannot serve ``query [n, heads, head_dim]``, or ``None``."""
    if not query.is_cuda:
        return "tensors are not on a CUDA device"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention needs float16 or bfloat16, got {query.dtype}"
    head_dim = query.shape[-1]
    if head_dim % 8 or head_dim > 256:
        return f"FlashAttention needs head_dim a multiple of 8 up to 256, got {head_dim}"
    if torch.cuda.get_device_capability(query.device) < (8, 0):
        return "FlashAttention needs compute capability 8.0 or later"
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return "this torch has no aten::_flash_attention_forward"
    return None


def _cumulative(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(lengths.size + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out
