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

from kvserve.kernels.host_to_device import to_device


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
    * ``captured``: the batch is being captured into a CUDA graph that will replay it
      over other contexts; the host copies (``seq_lens_cpu``, ``max_seq_len``) are then
      upper bounds of the replayed contexts, and the device's ``seq_lens`` the real ones.
      Kernels that plan on the host size each request's share of the work on the device.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    max_query_len: int
    max_seq_len: int
    captured: bool = False

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
    num_reqs = len(query_lens)
    if len(seq_lens) != num_reqs or len(block_tables) != num_reqs:
        raise ValueError(
            "query_lens, seq_lens and block_tables must have one entry per request, got "
            f"{num_reqs}, {len(seq_lens)} and {len(block_tables)}"
        )
    num_blocks = np.fromiter((len(row) for row in block_tables), dtype=np.int64, count=num_reqs)
    padded = np.zeros((num_reqs, int(num_blocks.max(initial=0))), dtype=np.int64)
    padded[np.arange(padded.shape[1])[None, :] < num_blocks[:, None]] = np.fromiter(
        (block_id for row in block_tables for block_id in row), dtype=np.int64, count=int(num_blocks.sum())
    )
    return attention_metadata_from_arrays(
        np.asarray(query_lens, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64), padded, block_size, device,
        num_blocks=num_blocks,
    )


def attention_metadata_from_arrays(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    device: torch.device | str,
    *,
    num_blocks: np.ndarray | None = None,
) -> AttentionMetadata:
    """``build_attention_metadata`` for callers that keep padded numpy block tables.

    ``block_tables`` is ``[num_reqs, max_blocks]``, padded with 0;
    ``num_blocks[r]`` (default: every column) is how many entries of row ``r``
    are real.  Validation is vectorised: no Python loop over requests.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    num_reqs = len(query_lens)
    if block_tables.ndim != 2 or block_tables.shape[0] != num_reqs or len(seq_lens) != num_reqs:
        raise ValueError(
            f"expected {num_reqs} seq_lens and block table rows, got {len(seq_lens)} and "
            f"{block_tables.shape[0] if block_tables.ndim == 2 else block_tables.shape}"
        )
    if num_blocks is None:
        num_blocks = np.full(num_reqs, block_tables.shape[1], dtype=np.int64)
    _raise_for_first(query_lens < 1, lambda r: f"query_lens[{r}] must be at least 1, got {query_lens[r]}")
    _raise_for_first(
        query_lens > seq_lens,
        lambda r: f"query_lens[{r}] ({query_lens[r]}) exceeds seq_lens[{r}] ({seq_lens[r]})",
    )
    num_blocks_needed = -(-seq_lens // block_size)
    _raise_for_first(
        num_blocks < num_blocks_needed,
        lambda r: f"block_tables[{r}] has {num_blocks[r]} blocks, but seq_lens[{r}] = {seq_lens[r]} "
        f"needs {num_blocks_needed[r]} blocks of {block_size}",
    )
    if block_tables.size and block_tables.min() < 0:
        raise ValueError("block ids must be non-negative")

    query_start_loc_np = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc_np[1:])
    num_tokens = int(query_start_loc_np[-1])
    # Request index and absolute position of every new token, without a loop over tokens.
    token_req_idx = np.repeat(np.arange(num_reqs), query_lens)
    offset_in_query = np.arange(num_tokens) - np.repeat(query_start_loc_np[:-1], query_lens)
    positions = np.repeat(seq_lens - query_lens, query_lens) + offset_in_query
    block_ids = block_tables[token_req_idx, positions // block_size].astype(np.int64)
    slot_mapping_np = block_ids * block_size + positions % block_size

    return AttentionMetadata(
        query_start_loc=to_device(query_start_loc_np.astype(np.int32), device),
        seq_lens=to_device(seq_lens.astype(np.int32), device),
        block_tables=to_device(np.ascontiguousarray(block_tables, dtype=np.int32), device),
        slot_mapping=to_device(slot_mapping_np, device),
        query_start_loc_cpu=tuple(query_start_loc_np.tolist()),
        seq_lens_cpu=tuple(seq_lens.tolist()),
        max_query_len=int(query_lens.max(initial=0)),
        max_seq_len=int(seq_lens.max(initial=0)),
    )


def _raise_for_first(bad: np.ndarray, message) -> None:
    """Raise ``ValueError(message(r))`` for the first request ``r`` where ``bad`` holds."""
    if bad.any():
        raise ValueError(message(int(np.flatnonzero(bad)[0])))
