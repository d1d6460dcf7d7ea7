"""Qwen3: Llama with a per-head RMSNorm on queries and keys before RoPE."""

from __future__ import annotations

from typing import Any

import torch

from kvserve.kernels import AttentionBackend
from kvserve.worker.distributed import TensorParallelGroup
from kvserve.worker.layers import RMSNorm, RotaryEmbedding
from kvserve.worker.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    """Llama attention (biases from ``config.attention_bias``) plus ``q_norm``/``k_norm``
    over ``head_dim``, replicated on every rank."""

    def __init__(
        self, config: Any, tp: TensorParallelGroup, backend: AttentionBackend, rotary_emb: RotaryEmbedding
    ) -> None:
        super().__init__(config, tp, backend, rotary_emb)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense) causal LM; a sliding window shorter than the context is rejected."""

    attention_cls = Qwen3Attention
