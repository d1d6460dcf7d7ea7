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
    num_kv_heads: int = NUM_KV_HEADS,
    head_dim: int = HEAD_DIM,
    shared_prefix: tuple[int, int] | None = None,
) -> PagedBatch:
    """Random K/V placed in shuffled, non-contiguous blocks of a NaN-filled cache.

    ``shared_prefix=(num_blocks, every)``: requests taken ``every`` at a time share
    the first full blocks of the first one of them (up to ``num_blocks``, and
    always leaving each request at least one block of its own), as a prefix
    cache would.
    """
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
    num_shared = [0] * len(requests)
    if shared_prefix is not None:
        max_shared, every = shared_prefix
        for r, table in enumerate(block_tables):
            lead = (r // every) * every
            # Full blocks of the first request only, as a prefix cache shares them.
            num_shared[r] = min(max_shared, seq_lens[lead] // block_size, -(-seq_lens[r] // block_size) - 1)
            table[: num_shared[r]] = block_tables[lead][: num_shared[r]]

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    keys, values = [], []
    for r, ((cached, new), seq_len, table) in enumerate(zip(requests, seq_lens, block_tables)):
        keys.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype))
        values.append(torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype))
        if num_shared[r]:  # the shared blocks hold what the first request of the group wrote
            lead, num_positions = (r // shared_prefix[1]) * shared_prefix[1], num_shared[r] * block_size
            keys[-1][:num_positions] = keys[lead][:num_positions]
            values[-1][:num_positions] = values[lead][:num_positions]
        for position in range(cached + new if write_new_tokens else cached):
            block_id, offset = table[position // block_size], position % block_size
            key_cache[block_id, offset] = keys[-1][position]
            value_cache[block_id, offset] = values[-1][position]
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=generator).to(dtype)
    metadata = build_attention_metadata(query_lens, seq_lens, block_tables, block_size, "cpu")
    return PagedBatch(query, key_cache, value_cache, metadata, keys, values, scale=0.7 * head_dim**-0.5)
