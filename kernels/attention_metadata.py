"""What every attention kernel needs to know about one mixed batch.

A batch holds prefill chunks and decodes together.  The new tokens of one
request are contiguous, requests in order::

    tokens:            | r0: 3 new (chunk) | r1: 1 (decode) | r2: 5 new |
    query_start_loc:   0                   3                4           9

Request ``r`` has ``seq_lens[r]`` tokens of context after this step: the
tokens already cached plus its new ones, so new token ``j`` sits at absolute
position ``seq_lens[r] - query_len + j``.  Position ``p`` lives in block
``block_tables[r][p // block_size]`` at offset ``p % block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """One mixed batch (prefill chunks and decodes).

    Tokens of one request are contiguous in the batch, requests in order.
    Tensors live on the compute device; the ``*_cpu`` tuples are host copies so
    that reference code can plan its work without syncing with the device.

    * ``query_start_loc``: int32 ``[num_reqs + 1]``, cumulative new-token counts, starts at 0.
    * ``seq_lens``: int32 ``[num_reqs]``, context length of each request after this step.
    * ``block_tables``: int32 ``[num_reqs, max_blocks_per_req]``, padded with 0 (the null block).
    * ``slot_mapping``: int64 ``[num_tokens]``, cache slot of each new token
      (``block_id * block_size + offset_in_block``).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str,
) -> AttentionMetadata:
    """Build the metadata of one batch from per-request host values.

    ``query_lens[r]`` is the number of new tokens of request ``r`` (at least 1),
    ``seq_lens[r]`` its context length after this step (at least
    ``query_lens[r]``), and ``block_tables[r]`` the ids of its blocks in order,
    at least ``ceil(seq_lens[r] / block_size)`` of them.  Raises ``ValueError``
    naming the offending request when any of this does not hold.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    num_reqs = len(query_lens)
    if len(seq_lens) != num_reqs or len(block_tables) != num_reqs:
        raise ValueError(
            "query_lens, seq_lens and block_tables must have one entry per request, got "
            f"{num_reqs}, {len(seq_lens)} and {len(block_tables)}"
        )
    query_lens_np = np.asarray(query_lens, dtype=np.int64).reshape(num_reqs)
    seq_lens_np = np.asarray(seq_lens, dtype=np.int64).reshape(num_reqs)
    max_blocks_per_req = max((len(row) for row in block_tables), default=0)
    block_tables_np = np.zeros((num_reqs, max_blocks_per_req), dtype=np.int64)
    for req_idx, (query_len, seq_len, row) in enumerate(zip(query_lens_np, seq_lens_np, block_tables)):
        if query_len < 1:
            raise ValueError(f"query_lens[{req_idx}] must be at least 1, got {query_len}")
        if query_len > seq_len:
            raise ValueError(
                f"query_lens[{req_idx}] ({query_len}) exceeds seq_lens[{req_idx}] ({seq_len})"
            )
        num_blocks_needed = -(-int(seq_len) // block_size)
        if len(row) < num_blocks_needed:
            raise ValueError(
                f"block_tables[{req_idx}] has {len(row)} blocks, but seq_lens[{req_idx}] = {seq_len} "
                f"needs {num_blocks_needed} blocks of {block_size}"
            )
        block_tables_np[req_idx, : len(row)] = row
    if (block_tables_np < 0).any():
        raise ValueError("block ids must be non-negative")

    query_start_loc_np = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens_np, out=query_start_loc_np[1:])
    num_tokens = int(query_start_loc_np[-1])
    # Request index and absolute position of every new token, without a loop over tokens.
    token_req_idx = np.repeat(np.arange(num_reqs), query_lens_np)
    offset_in_query = np.arange(num_tokens) - np.repeat(query_start_loc_np[:-1], query_lens_np)
    positions = np.repeat(seq_lens_np - query_lens_np, query_lens_np) + offset_in_query
    block_ids = block_tables_np[token_req_idx, positions // block_size]
    slot_mapping_np = block_ids * block_size + positions % block_size

    return AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc_np, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens_np, dtype=torch.int32, device=device),
        block_tables=torch.tensor(block_tables_np, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slot_mapping_np, dtype=torch.int64, device=device),
        query_start_loc_cpu=tuple(int(x) for x in query_start_loc_np),
        seq_lens_cpu=tuple(int(x) for x in seq_lens_np),
        max_query_len=int(query_lens_np.max(initial=0)),
        max_seq_len=int(seq_lens_np.max(initial=0)),
    )
