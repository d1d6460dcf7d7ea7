"""Model classes by Hugging Face architecture name."""

from __future__ import annotations

from typing import Any

from torch import nn

from kvserve.worker.models.llama import LlamaForCausalLM, MistralForCausalLM
from kvserve.worker.models.qwen2 import Qwen2ForCausalLM
from kvserve.worker.models.qwen3 import Qwen3ForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
# Used only when a config names no architecture.
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def get_model_class(config: Any) -> type[nn.Module]:
    """The class for ``config.architectures`` (falling back on ``config.model_type`` when
    it names none); ValueError naming the supported ones otherwise."""
    architectures = list(getattr(config, "architectures", None) or ())
    if not architectures:
        model_type = getattr(config, "model_type", None)
        if model_type not in _MODEL_TYPES:
            raise ValueError(
                f"config names no architecture and model_type {model_type!r} is not one of "
                f"{sorted(_MODEL_TYPES)}"
            )
        architectures = [_MODEL_TYPES[model_type]]
    for name in architectures:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    raise ValueError(
        f"unsupported architecture(s) {architectures}; supported: {supported_architectures()}"
    )
