"""Model building blocks with tensor parallelism built in, one layer kind per file."""

from __future__ import annotations

from kvserve.worker.layers.activation import SiluAndMul
from kvserve.worker.layers.attention import Attention
from kvserve.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvserve.worker.layers.layernorm import RMSNorm
from kvserve.worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from kvserve.worker.layers.rotary_embedding import RotaryEmbedding, get_rope

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "get_rope",
]
