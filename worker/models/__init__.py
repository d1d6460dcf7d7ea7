"""Model definitions, one family per file, and the architecture registry."""

from __future__ import annotations

from kvserve.worker.models.llama import LlamaForCausalLM, MistralForCausalLM
from kvserve.worker.models.qwen2 import Qwen2ForCausalLM
from kvserve.worker.models.qwen3 import Qwen3ForCausalLM
from kvserve.worker.models.registry import get_model_class, supported_architectures

__all__ = [
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "get_model_class",
    "supported_architectures",
]
