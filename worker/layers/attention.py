"""The attention layer: new K/V into the paged cache, then paged attention over it."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """Attention of one layer on one rank, over that rank's shard of the heads.

    ``num_heads`` and ``num_kv_heads`` are this rank's (local) counts. The layer owns no
    weights; its KV cache is passed in at every call as ``(key_cache, value_cache)``,
    each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.backend = backend

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``query [n, num_heads * head_dim]`` (or ``[n, num_heads, head_dim]``), ``key``
        and ``value`` likewise with ``num_kv_heads``; returns ``[n, num_heads * head_dim]``.
        """
        key_cache, value_cache = kv_cache
        if key_cache.dim() != 4 or tuple(key_cache.shape[2:]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"KV cache of shape {tuple(key_cache.shape)} does not hold {self.num_kv_heads} "
                f"KV heads of {self.head_dim}"
            )
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        self.backend.write_kv_cache(key, value, key_cache, value_cache, attn_metadata.slot_mapping)
        output = self.backend.paged_attention(query, key_cache, value_cache, attn_metadata, self.scale)
        return output.view(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, scale={self.scale:.4g}, backend={self.backend.name}"
        )
