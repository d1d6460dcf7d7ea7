"""Random paged-attention batches shared by the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kernels import AttentionMetadata, build_attention_metadata

NUM_KV_HEADS = 2
HEAD_DIM = 16
# (cached tokens, new tokens) per request: chunks with and without cached context,
# decodes that are not contiguous in the batch, contexts ending mid-block and on a boundary.
MIXED_BATCH = [(0, 7), (37, 1), (20, 13), (63, 1), (0, 1), (5, 1), (16, 16)]


@dataclass(frozen=True, slots=True)
class PagedBatch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    metadata: AttentionMetadata
    keys: list[torch.Tensor]  # dense [seq_len, num_kv_heads, head_dim] per request
    values: list[torch.Tensor]
    scale: float


def make_batch(
    requests: list[tuple[int, int]],
    *,
    block_size: int,
    group: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    write_new_tokens: bool = True,
) -> PagedBatch:
    """Random K/V placed in shuffled, non-contiguous blocks of a NaN-filled cache."""
    generator = torch.Generator().manual_seed(seed)
    query_lens = [new for _, new in requests]
    seq_lens = [cached + new for cached, new in requests]
    # Every other table carries one unused trailing block.
    blocks_per_req = [-(-seq_len // block_size) + r % 2 for r, seq_len in enumerate(seq_lens)]
    num_blocks = sum(blocks_per_req) + 4
    free_block_ids = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    block_tables = []
    for count in blocks_per_req:
        block_tables.append(free_block_ids[:count])
        del free_block_ids[:count]

    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    keys, values = [], []
    for (cached, new), seq_len, table in zip(requests, seq_lens, block_tables):
        keys.append(torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype))
        values.append(torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype))
        for position in range(cached + new if write_new_tokens else cached):
            block_id, offset = table[position // block_size], position % block_size
            key_cache[block_id, offset] = keys[-1][position]
            value_cache[block_id, offset] = values[-1][position]
    query = torch.randn(sum(query_lens), NUM_KV_HEADS * group, HEAD_DIM, generator=generator).to(dtype)
    metadata = build_attention_metadata(query_lens, seq_lens, block_tables, block_size, "cpu")
    return PagedBatch(query, key_cache, value_cache, metadata, keys, values, scale=0.7 * HEAD_DIM**-0.5)
