"""How the CUDA kernels cut one batch's contexts into splits (flash-decoding).

A decode CTA reads one kv head's K/V over one split of a request's context.  With few
requests a whole context per CTA would leave most of the GPU idle (batch 1, 8 kv heads:
8 CTAs on 132 SMs), so contexts are cut into splits of ``split_tokens`` positions and a
second kernel combines the splits' partial softmax sums.  The split size is chosen per
batch so that the launch has about ``TARGET_CTAS_PER_SM`` CTAs per SM (two waves at four
resident CTAs per SM), and no smaller than ``MIN_SPLIT_TOKENS`` so that every CTA has
enough keys to hide its start-up.  One split size serves the batch's decode and prefill
launches; a context shorter than one split needs no combine.

The combine's workspace holds a float32 partial output of ``head_dim + 2`` values per
(token, query head, split) of the batch, for every token of it.  NOTE: with one split size
for both launches, one short decode beside a long prefill chunk made the size small
(128) and the chunk's context many splits: a 2,048-token chunk over 32k cached tokens and
one decode needed 8.7 GB (32 query heads, head_dim 128).  So the chosen size is raised
until the workspace fits ``MAX_WORKSPACE_BYTES`` (the decode then has fewer splits, in a
launch the prefill keeps busy anyway), or to ``MAX_SPLIT_TOKENS``: contexts longer than
that still need ``ceil(context / MAX_SPLIT_TOKENS)`` splits (2,048 tokens over 128k: 0.5 GB).

Pure Python on host values (``AttentionMetadata``'s ``*_cpu`` tuples): no device sync.
The constants mirror ``csrc/paged_attention_cuda.h`` (a CPU test checks that they agree).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Kernel limits, from csrc/paged_attention_cuda.h.
MAX_SPLIT_TOKENS = 8192
SPLIT_TOKENS_MULTIPLE = 64
PREFILL_ROWS = 8
MAX_DECODE_ROWS = 8
# Tuning (see the module docstring).
MIN_SPLIT_TOKENS = 128
TARGET_CTAS_PER_SM = 8
MAX_WORKSPACE_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """Context positions per split, and the split count of each launch (0: no launch)."""

    split_tokens: int
    num_decode_splits: int
    num_prefill_splits: int

    @property
    def max_splits(self) -> int:
        return max(self.num_decode_splits, self.num_prefill_splits)


def decode_rows_for_group(group: int) -> int:
    """Query heads per decode CTA, as the kernels choose them."""
    return 1 if group <= 1 else 4 if group <= 4 else MAX_DECODE_ROWS


def check_split_tokens(split_tokens: int) -> None:
    """Raise ``ValueError`` unless ``split_tokens`` is a split size the kernels accept."""
    if (
        isinstance(split_tokens, bool)
        or not isinstance(split_tokens, int)
        or not 0 < split_tokens <= MAX_SPLIT_TOKENS
        or split_tokens % SPLIT_TOKENS_MULTIPLE
    ):
        raise ValueError(
            f"split_tokens must be a positive multiple of {SPLIT_TOKENS_MULTIPLE} up to {MAX_SPLIT_TOKENS}, "
            f"got {split_tokens!r}"
        )


def plan_splits(
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    num_kv_heads: int,
    group: int,
    num_sms: int,
    split_tokens: int | None = None,
    *,
    head_dim: int,
) -> SplitPlan:
    """The split plan of one batch (host copies of its metadata).

    Requests with one new token are decodes, the others prefills, as in
    :func:`kvserve.kernels.reference.split_decode_and_prefill`.  ``split_tokens``
    forces the split size (tests, benchmarks); ``None`` chooses it as the module
    docstring says (``head_dim`` sizes the workspace).
    """
    decode_lens: list[int] = []
    prefill_lens: list[int] = []
    num_prefill_tiles = 0
    for start, end, seq_len in zip(query_start_loc, query_start_loc[1:], seq_lens):
        query_len = end - start
        if query_len == 1:
            decode_lens.append(seq_len)
        else:
            prefill_lens.append(seq_len)
            num_prefill_tiles += -(-query_len * group // PREFILL_ROWS)
    if split_tokens is None:
        target_ctas = TARGET_CTAS_PER_SM * num_sms
        candidates = [MAX_SPLIT_TOKENS]
        if decode_lens:
            head_tiles = -(-group // decode_rows_for_group(group))
            num_items = len(decode_lens) * num_kv_heads * head_tiles
            candidates.append(_split_tokens_for(max(decode_lens), num_items, target_ctas))
        if prefill_lens:
            candidates.append(_split_tokens_for(max(prefill_lens), num_prefill_tiles * num_kv_heads, target_ctas))
        split_tokens = min(candidates)
        max_len = max(decode_lens + prefill_lens, default=0)
        split_bytes = (query_start_loc[-1] - query_start_loc[0]) * num_kv_heads * group * (head_dim + 2) * 4
        if -(-max_len // split_tokens) * split_bytes > MAX_WORKSPACE_BYTES:
            # Few enough splits for the budget (at least one), each a multiple of 64 tokens.
            fewest_tokens = -(-max_len // max(MAX_WORKSPACE_BYTES // split_bytes, 1))
            fewest_tokens = -(-fewest_tokens // SPLIT_TOKENS_MULTIPLE) * SPLIT_TOKENS_MULTIPLE
            split_tokens = min(max(split_tokens, fewest_tokens), MAX_SPLIT_TOKENS)
    else:
        check_split_tokens(split_tokens)
    return SplitPlan(
        split_tokens=split_tokens,
        num_decode_splits=-(-max(decode_lens) // split_tokens) if decode_lens else 0,
        num_prefill_splits=-(-max(prefill_lens) // split_tokens) if prefill_lens else 0,
    )


def _split_tokens_for(max_seq_len: int, num_items: int, target_ctas: int) -> int:
    """The split size that gives ``num_items`` work items about ``target_ctas`` CTAs."""
    wanted_splits = -(-target_ctas // max(num_items, 1))
    tokens = -(-max_seq_len // wanted_splits)
    tokens = -(-tokens // SPLIT_TOKENS_MULTIPLE) * SPLIT_TOKENS_MULTIPLE
    return min(max(tokens, MIN_SPLIT_TOKENS), MAX_SPLIT_TOKENS)
