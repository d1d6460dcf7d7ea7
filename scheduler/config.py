"""Configuration of the control plane: the KV cache and the step scheduler.

Each dataclass is frozen and validated once; derived values are produced with
``dataclasses.replace``.  Invalid values raise ``ValueError`` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.scheduler.checks import check_block_size, check_num_blocks, check_positive_ints, check_tenant_cache_share


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache of one replica, as the control plane sees it.

    ``num_blocks`` counts every block including the null block (id 0), so a
    pool of ``num_blocks`` hands out at most ``num_blocks - 1`` blocks.
    ``model_id`` is mixed into every block hash so that caches of different
    models or adapters never match.  ``tenant_cache_share``: the share of the usable
    blocks a tenant's cached blocks may hold before its cache is evicted ahead of the
    others' (``kvserve.scheduler.tenant_block_pool``); ``None``: one LRU order for everyone.
    """

    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    model_id: str = ""
    tenant_cache_share: float | None = None

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        check_num_blocks(self.num_blocks)
        check_tenant_cache_share(self.tenant_cache_share)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one replica's step scheduler.

    ``max_num_batched_tokens`` is the token budget of one step (prefill chunks
    plus one token per decode), ``max_num_seqs`` the most requests running at
    once, and ``max_model_len`` the longest sequence (prompt + output).
    ``long_prefill_token_threshold`` caps one request's prefill chunk per step
    so that several long prompts progress together (``None``: no cap).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None

    def __post_init__(self) -> None:
        check_positive_ints(max_num_batched_tokens=self.max_num_batched_tokens)
        check_positive_ints(max_num_seqs=self.max_num_seqs)
        check_positive_ints(max_model_len=self.max_model_len)
        if self.long_prefill_token_threshold is not None:
            check_positive_ints(long_prefill_token_threshold=self.long_prefill_token_threshold)
            if not self.enable_chunked_prefill:
                raise ValueError("long_prefill_token_threshold needs chunked prefill, which enable_chunked_prefill=False turns off")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len when chunked prefill is off "
                f"(got {self.max_num_batched_tokens} < {self.max_model_len}): "
                "a long prompt could never be scheduled"
            )
