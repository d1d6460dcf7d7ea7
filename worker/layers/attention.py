"""The attention layer: new K/V into the paged cache, then paged attention over it."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels import AttentionBackend, AttentionMetadata
from kvserve.kernels.fused_elementwise import fused_kernels_apply, rope_and_write_kv
from kvserve.worker.layers.rotary_embedding import RotaryEmbedding


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
        self._check_cache(kv_cache)
        return self._write_and_attend(query, key, value, kv_cache, attn_metadata)

    def forward_packed(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        rotary_emb: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention of a fused projection's rows ``qkv [n, (num_heads + 2 * num_kv_heads) *
        head_dim]`` (q heads, then k, then v): q and k rotated by ``positions``, k and v into
        the cache, then as :meth:`forward`.

        Where the fused kernels run (half precision on CUDA), the rotation and the cache
        write are one kernel (``rope_and_write_kv``); elsewhere q and k (adjacent in ``qkv``)
        are rotated in one call and the backend writes the cache.  Both give the same values.
        """
        self._check_cache(kv_cache)
        key_cache, value_cache = kv_cache
        num_tokens = qkv.shape[0]
        qk_size = (self.num_heads + self.num_kv_heads) * self.head_dim
        if (
            fused_kernels_apply(qkv)
            and key_cache.dtype == value_cache.dtype == qkv.dtype
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
        ):
            cos, sin = rotary_emb.cos_sin(positions, qkv.dtype)
            query = rope_and_write_kv(qkv, cos, sin, key_cache, value_cache, attn_metadata.slot_mapping, self.num_heads)
            return self._attend(query, kv_cache, attn_metadata)
        qk = rotary_emb.rotate(positions, qkv[:, :qk_size].view(num_tokens, -1, self.head_dim))
        return self._write_and_attend(
            qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, qk_size:], kv_cache, attn_metadata)

    def _check_cache(self, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        key_cache = kv_cache[0]
        if key_cache.dim() != 4 or tuple(key_cache.shape[2:]) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"KV cache of shape {tuple(key_cache.shape)} does not hold {self.num_kv_heads} "
                f"KV heads of {self.head_dim}"
            )

    def _write_and_attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        self.backend.write_kv_cache(key, value, *kv_cache, attn_metadata.slot_mapping)
        return self._attend(query, kv_cache, attn_metadata)

    def _attend(
        self, query: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        output = self.backend.paged_attention(query, *kv_cache, attn_metadata, self.scale)
        return output.view(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, scale={self.scale:.4g}, backend={self.backend.name}"
        )
