"""The attention backend interface, declared once.

A backend writes new K/V into the paged cache and attends over it, following the
contracts of :mod:`kvserve.kernels.reference`, which it must match numerically
(within its dtype's tolerance).  Inputs its kernels lack (a dtype, a head size, a
device) take the reference instead: each backend says why it cannot run them
(``cannot_write``, ``cannot_attend``), and implements only the kernel paths
(``_write``, ``_attend``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvserve.kernels import reference
from kvserve.kernels.attention_metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Cache writes and paged attention; see the module docstring."""

    __slots__ = ()
    name: str

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key``/``value`` ``[n, kv_heads, head_dim]`` into the caches at ``slot_mapping``."""
        if self.cannot_write(key, value, key_cache, value_cache) is not None:
            reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
        else:
            self._write(key, value, key_cache, value_cache, slot_mapping)

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of ``query`` ``[n, heads, head_dim]`` over the cache, as ``metadata`` describes."""
        reason = self.cannot_attend(query, key_cache, value_cache)
        if reason is not None:
            self._falls_back(reason)
            return reference.paged_attention(query, key_cache, value_cache, metadata, scale)
        reference.check_inputs(query, key_cache, value_cache, metadata, scale)
        return self._attend(query, key_cache, value_cache, metadata, scale)

    def cannot_write(
        self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> str | None:
        """Why the kernels cannot write these tensors, or ``None`` when they can."""
        return None

    def cannot_attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> str | None:
        """Why the kernels cannot attend over these tensors, or ``None`` when they can."""
        return None

    def _falls_back(self, reason: str) -> None:
        """Called when an attention call takes the reference for ``reason``."""

    @abstractmethod
    def _write(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    @abstractmethod
    def _attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...
