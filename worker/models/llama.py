"""Llama and Mistral, tensor-parallel, on a paged KV cache.

The blocks here are shared by the Qwen families: they subclass :class:`LlamaAttention`
(biases, per-head q/k norm) and :class:`LlamaForCausalLM` (``attention_cls``).
Parameter names follow Hugging Face checkpoints, except that ``q/k/v_proj`` are stacked
into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj`` (see
``LlamaForCausalLM.packed_modules_mapping``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from kvserve.kernels import AttentionBackend, AttentionMetadata
from kvserve.worker.distributed import TensorParallelGroup
from kvserve.worker.layers import (
    Attention,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    get_rope,
)
from kvserve.worker.layers.embedding import DEFAULT_VOCAB_PARALLEL

KVCache = tuple[torch.Tensor, torch.Tensor]


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``; gate/up column-parallel, down row-parallel."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool, tp: TensorParallelGroup
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads. ``qkv_bias``/``o_bias`` default to
    ``config.attention_bias``."""

    def __init__(
        self,
        config: Any,
        tp: TensorParallelGroup,
        backend: AttentionBackend,
        rotary_emb: RotaryEmbedding,
        *,
        qkv_bias: bool | None = None,
        o_bias: bool | None = None,
    ) -> None:
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim_of(config)
        qkv_bias = bias if qkv_bias is None else qkv_bias
        o_bias = bias if o_bias is None else o_bias
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, num_heads, num_kv_heads, qkv_bias, tp
        )
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size, o_bias, tp)
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, backend)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook before RoPE on ``[n, heads, head_dim]`` views; identity for Llama."""
        return q, k

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        if type(self).normalize_qk is LlamaAttention.normalize_qk:
            # No hook between the projection and RoPE: the attention layer takes the packed rows.
            return self.o_proj(self.attn.forward_packed(positions, qkv, self.rotary_emb, kv_cache, attn_metadata))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, *self.normalize_qk(q, k))
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; carries the residual stream separately so the
    residual add fuses into the next RMSNorm."""

    def __init__(
        self,
        config: Any,
        tp: TensorParallelGroup,
        backend: AttentionBackend,
        rotary_emb: RotaryEmbedding,
        attention_cls: type[LlamaAttention],
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, tp, backend, rotary_emb)
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, mlp_bias, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm: token ids to final hidden states."""

    def __init__(
        self,
        config: Any,
        tp: TensorParallelGroup,
        backend: AttentionBackend,
        attention_cls: type[LlamaAttention],
        vocab_parallel: bool,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, vocab_parallel)
        # One RoPE module shared by every layer (its state: a non-persistent buffer, and
        # the angles of the current pass).
        self.rotary_emb = get_rope(head_dim_of(config), config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, tp, backend, self.rotary_emb, attention_cls)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV caches (one per layer), got {len(kv_caches)}")
        hidden_states, residual = self.embed_tokens(input_ids), None
        self.rotary_emb.clear_cache()
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM sharded over ``tp``.

    ``forward(input_ids [n], positions [n], kv_caches, attn_metadata) -> [n, hidden]``
    runs a mixed prefill/decode batch; ``kv_caches[i]`` is layer ``i``'s
    ``(key_cache, value_cache)``, each ``[num_blocks, block_size, num_local_kv_heads,
    head_dim]``. ``compute_logits(hidden [m, hidden]) -> [m, vocab]`` float32 on every rank.
    """

    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention
    # checkpoint module name -> (our module name, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        config: Any,
        tp: TensorParallelGroup,
        attention_backend: AttentionBackend,
        *,
        vocab_parallel: bool = DEFAULT_VOCAB_PARALLEL,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, tp, attention_backend, self.attention_cls, vocab_parallel)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, vocab_parallel)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's key (and value) cache on this rank."""
        attn = self.model.layers[0].self_attn
        return (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's architecture; a sliding window shorter than the longest sequence is
    rejected by ``load_model``."""
