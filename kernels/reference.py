"""Pure-torch reference kernels: write new K/V into the paged cache, then attend.

The cache layout is ``[num_blocks, block_size, num_kv_heads, head_dim]`` for
keys and values alike, so slot ``s`` is row ``s`` of the cache viewed as
``[num_blocks * block_size, num_kv_heads, head_dim]``.

These run on any device and are the ground truth for the CUDA kernels.  They
plan their work from the host copies in ``AttentionMetadata`` and never sync.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvserve.kernels.attention_metadata import AttentionMetadata

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token ``t``'s key and value into cache slot ``slot_mapping[t]``, in place.

    ``key``/``value``: ``[num_tokens, num_kv_heads, head_dim]``; caches:
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` (contiguous);
    ``slot_mapping``: int64 ``[num_tokens]``.  Every other slot is left as it was.
    """
    if key.shape != value.shape or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key/value shapes {tuple(key.shape)}/{tuple(value.shape)} and cache shapes "
            f"{tuple(key_cache.shape)}/{tuple(value_cache.shape)} must match pairwise"
        )
    if key.dim() != 3 or key_cache.dim() != 4 or key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(
            f"key {tuple(key.shape)} must be [num_tokens, num_kv_heads, head_dim] and the cache "
            f"{tuple(key_cache.shape)} [num_blocks, block_size, num_kv_heads, head_dim]"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}, expected ({key.shape[0]},)")
    # NOTE: view (not reshape) so that a non-contiguous cache fails loudly
    # instead of silently writing into a copy.
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    key_cache.view(num_slots, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(num_slots, *value_cache.shape[2:]).index_copy_(
        0, slot_mapping, value.to(value_cache.dtype)
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every new token over its request's cached context.

    ``query``: ``[num_tokens, num_heads, head_dim]`` with ``num_heads`` a
    multiple of ``num_kv_heads``; query head ``h`` reads kv head
    ``h // (num_heads // num_kv_heads)``.  The new tokens' K/V must already be
    in the cache.  New token ``j`` of request ``r`` (absolute position
    ``p = seq_len - query_len + j``) attends to cache positions ``0..p``, read
    through ``block_tables[r]``.  Returns ``[num_tokens, num_heads, head_dim]``
    in ``query``'s dtype; half-precision inputs are computed in float32.
    """
    check_inputs(query, key_cache, value_cache, metadata, scale)
    return attend_checked(query, key_cache, value_cache, metadata, scale)


def attend_checked(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """``paged_attention`` of inputs that ``check_inputs`` passed (a backend checks them once)."""
    output = torch.empty_like(query)
    decode_reqs, prefill_reqs = split_decode_and_prefill(metadata)
    if decode_reqs:
        decode_attention(query, key_cache, value_cache, metadata, scale, decode_reqs, output)
    prefill_attention(query, key_cache, value_cache, metadata, scale, prefill_reqs, output)
    return output


def split_decode_and_prefill(metadata: AttentionMetadata) -> tuple[list[int], list[int]]:
    """Indices of the requests with one new token (decodes) and of those with more (prefills)."""
    starts = metadata.query_start_loc_cpu
    decode_reqs = [r for r in range(metadata.num_reqs) if starts[r + 1] - starts[r] == 1]
    prefill_reqs = [r for r in range(metadata.num_reqs) if starts[r + 1] - starts[r] > 1]
    return decode_reqs, prefill_reqs


def check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> None:
    """Raise ``ValueError`` unless the inputs fit :func:`paged_attention`'s contract.

    ``scale`` (the logits' factor) must be a positive finite number.  NOTE:
    under a causal mask torch's ``scaled_dot_product_attention`` returns NaN
    for a scale of 0 or below; no model uses one.
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"query {tuple(query.shape)} must be [num_tokens, num_heads, head_dim] and both caches "
            f"[num_blocks, block_size, num_kv_heads, head_dim], got {tuple(key_cache.shape)}/"
            f"{tuple(value_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query has {num_heads} heads of {head_dim}; the cache has {num_kv_heads} kv heads of "
            f"{key_cache.shape[3]} (heads must match and num_heads be a multiple of num_kv_heads)"
        )
    if metadata.num_tokens != num_tokens:
        raise ValueError(f"metadata describes {metadata.num_tokens} tokens, query has {num_tokens}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _HALF_DTYPES else dtype


def select_rows(tensor: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """``tensor[indices]``, as a view when the indices are one contiguous run."""
    if indices == list(range(indices[0], indices[0] + len(indices))):
        return tensor[indices[0] : indices[0] + len(indices)]
    return tensor.index_select(0, torch.tensor(indices, device=tensor.device))


def write_rows(tensor: torch.Tensor, indices: list[int], rows: torch.Tensor) -> None:
    """``tensor[indices] = rows``, through a slice when the indices are one contiguous run."""
    if indices == list(range(indices[0], indices[0] + len(indices))):
        tensor[indices[0] : indices[0] + len(indices)] = rows
    else:
        tensor.index_copy_(0, torch.tensor(indices, device=tensor.device), rows)


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    decode_reqs: list[int],
    output: torch.Tensor,
) -> None:
    """Attention of the single-token requests ``decode_reqs`` (non-empty), written into
    their rows of ``output``: all at once, their contexts gathered and padded to the longest."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    num_decodes = len(decode_reqs)
    max_context = max(metadata.seq_lens_cpu[r] for r in decode_reqs)
    compute_dtype = _compute_dtype(query.dtype)

    num_blocks = -(-max_context // block_size)
    block_ids = select_rows(metadata.block_tables, decode_reqs)[:, :num_blocks].to(torch.int64)
    offsets = torch.arange(block_size, device=query.device)
    slots = (block_ids[:, :, None] * block_size + offsets).view(num_decodes, -1)[:, :max_context]
    seq_lens = select_rows(metadata.seq_lens, decode_reqs).to(torch.int64)
    is_valid = torch.arange(max_context, device=query.device)[None, :] < seq_lens[:, None]
    # NOTE: padding positions re-read the request's last token rather than
    # slots that may never have been written (NaN in an uninitialized cache
    # would survive the mask: NaN - inf = NaN, 0 * NaN = NaN).
    last_slots = slots.gather(1, seq_lens[:, None] - 1)
    slots = torch.where(is_valid, slots, last_slots).view(-1)
    kv_shape = (num_decodes, max_context, num_kv_heads, head_dim)
    keys = key_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).view(kv_shape)
    values = value_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots).view(kv_shape)

    # q: [n, kv_heads, group, head_dim]; k, v: [n, kv_heads, max_context, head_dim]
    token_indices = [metadata.query_start_loc_cpu[r] for r in decode_reqs]
    queries = select_rows(query, token_indices).to(compute_dtype)
    queries = queries.reshape(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    attended = F.scaled_dot_product_attention(
        queries,
        keys.to(compute_dtype).transpose(1, 2),
        values.to(compute_dtype).transpose(1, 2),
        attn_mask=is_valid[:, None, None, :],
        scale=scale,
    )
    write_rows(output, token_indices, attended.reshape(num_decodes, num_heads, head_dim).to(output.dtype))


def prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    prefill_reqs: list[int],
    output: torch.Tensor,
) -> None:
    """Attention of the multi-token requests ``prefill_reqs``, one request at a time,
    written into their rows of ``output``."""
    starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    for req_idx in prefill_reqs:
        token_slice = slice(starts[req_idx], starts[req_idx + 1])
        output[token_slice] = _prefill_one_request(
            query[token_slice], key_cache, value_cache, metadata.block_tables[req_idx], seq_lens[req_idx], scale
        )


def _prefill_one_request(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One request's chunk of ``query_len`` new tokens over its ``seq_len`` tokens of context.

    The query heads that share a kv head read it through a stride-0 view, so
    GQA costs no copy of K/V::

        q: [kv_heads, group, query_len, head_dim]    k, v: [kv_heads, group (expanded), seq_len, head_dim]
    """
    query_len, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    compute_dtype = _compute_dtype(query.dtype)

    block_ids = block_table[: -(-seq_len // block_size)]
    kv_shape = (num_kv_heads, group, seq_len, head_dim)
    keys = key_cache.index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[:seq_len]
    values = value_cache.index_select(0, block_ids).view(-1, num_kv_heads, head_dim)[:seq_len]
    keys = keys.to(compute_dtype).transpose(0, 1)[:, None].expand(kv_shape)
    values = values.to(compute_dtype).transpose(0, 1)[:, None].expand(kv_shape)
    queries = query.to(compute_dtype).reshape(query_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)

    num_cached = seq_len - query_len
    if num_cached == 0:
        attended = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)
    else:
        # Causal with the cached context in front: new token j sees positions <= num_cached + j.
        key_positions = torch.arange(seq_len, device=query.device)
        query_positions = torch.arange(num_cached, seq_len, device=query.device)
        allowed = key_positions[None, :] <= query_positions[:, None]
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=allowed, scale=scale)
    return attended.permute(2, 0, 1, 3).reshape(query_len, num_heads, head_dim).to(query.dtype)
