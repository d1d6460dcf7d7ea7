"""Qwen2: Llama with biases on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from typing import Any

from kvserve.kernels import AttentionBackend
from kvserve.worker.distributed import TensorParallelGroup
from kvserve.worker.layers import RotaryEmbedding
from kvserve.worker.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    """Llama attention with ``q/k/v_proj`` biases (Qwen2 configs have no ``attention_bias``)."""

    def __init__(
        self, config: Any, tp: TensorParallelGroup, backend: AttentionBackend, rotary_emb: RotaryEmbedding
    ) -> None:
        super().__init__(config, tp, backend, rotary_emb, qkv_bias=True, o_bias=False)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 causal LM; a sliding window shorter than the context is rejected."""

    attention_cls = Qwen2Attention
