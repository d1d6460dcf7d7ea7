"""Model directories of a published model's size, with random weights, for timing.

Calibrating the step cost model (``python -m kvserve.bench.calibrate_cost_model
--shape llama-3-8b``) means timing a model of a real size on a real GPU, and no
model hub can be reached.  ``create_full_size_model`` writes a checkpoint with
the architecture of a published model (the ``config.json`` fields that set its
size), random weights, and the tiny models' tokenizer.  A step's time depends on
the shapes, not on the values, so this times like the real model.

The weights are drawn tensor by tensor on ``device`` (a GPU draws 8 billion in
seconds) and written as sharded safetensors with an index, as the hub's
checkpoints are; nothing of the model is ever held whole in host memory.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file

from kvserve.worker.model_loader import SAFETENSORS_INDEX
from kvserve.worker.tiny_model import (
    FAMILIES,
    greedy_generation_config,
    parameter_seed,
    staged_model_directory,
    tiny_config,
    write_tokenizer,
)

logger = logging.getLogger(__name__)

# The config fields that give each published model its size.  Everything else
# (BOS/EOS ids, the tokenizer) is the tiny models'.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.2-1b": ("llama", {
        "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    }),
    "llama-3-8b": ("llama", {
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    }),
    "qwen2.5-7b": ("qwen2", {
        "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "head_dim": 128, "intermediate_size": 18944, "vocab_size": 152064, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    }),
}

_WEIGHT_STD = 0.02
SHARD_BYTES = 4 << 30


def create_full_size_model(
    path: str | os.PathLike[str],
    shape: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
    **config_overrides: Any,
) -> Path:
    """Write a model directory of the published model ``shape`` (a key of ``SHAPES``) to ``path``.

    Weights are normal with std 0.02 (norm weights 1), drawn on ``device`` from a
    generator seeded by ``(seed, name)``, stored as ``dtype`` in safetensors
    files of at most ``shard_bytes`` (one tensor larger than that gets a file of
    its own) listed in ``model.safetensors.index.json``.  ``config_overrides``
    replace fields of the shape, e.g. ``num_hidden_layers=2`` for a quick test.

    Raises ``ValueError`` for an unknown shape, override, dtype or seed, or
    overrides that do not fit together, and ``FileExistsError`` if ``path``
    exists and is not an empty directory.  Nothing is left at ``path`` when
    writing fails.
    """
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ValueError(f"shard_bytes must be a positive integer, got {shard_bytes!r}")
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not an empty directory")
    family, fields = SHAPES[shape]
    config = _config(family, {**fields, **config_overrides})
    config.dtype = dtype
    with torch.device("meta"):
        # NOTE: named_parameters() lists a tied lm_head once, as the embedding.
        params = [(name, tuple(p.shape)) for name, p in FAMILIES[family].model_class(config).named_parameters()]
    item_size = torch.empty((), dtype=dtype).element_size()
    shards = _group_into_shards(params, item_size, shard_bytes)

    # NOTE: a failure (no CUDA for device="cuda", a full disk) left config and
    # tokenizer without weights at ``path``, and a retry was refused.
    with staged_model_directory(path) as staging:
        _write(staging, config, shards, item_size, seed, dtype, device, shape)
    return path


def _config(family: str, fields: dict[str, Any]) -> transformers.PretrainedConfig:
    """The family's config with ``fields``; ``ValueError`` for fields that do not fit together."""
    try:
        config = tiny_config(family, **fields)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers' own validation errors
        raise ValueError(f"the config does not fit together: {str(exc).splitlines()[0]}") from None
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    return config


def _write(
    path: Path, config: transformers.PretrainedConfig, shards: list[list[tuple[str, tuple[int, ...]]]],
    item_size: int, seed: int, dtype: torch.dtype, device: str | torch.device, shape: str,
) -> None:
    start = time.perf_counter()
    config.save_pretrained(path)
    greedy_generation_config(config).save_pretrained(path)
    write_tokenizer(path, config.max_position_embeddings)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for index, shard in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _random_weight(name, shape_, seed, dtype, device).cpu() for name, shape_ in shard}
        save_file(tensors, str(path / file_name), metadata={"format": "pt"})
        total_bytes += sum(t.numel() * item_size for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file_name))
        logger.info("wrote %s (%d of %d)", file_name, index, len(shards))
    index_json = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (path / SAFETENSORS_INDEX).write_text(json.dumps(index_json, indent=2) + "\n", encoding="utf-8")
    logger.info("wrote %s (%.2f GB of %s weights) in %.0f s", shape, total_bytes / 1e9, dtype,
                time.perf_counter() - start)


def _group_into_shards(
    params: list[tuple[str, tuple[int, ...]]], item_size: int, shard_bytes: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    used = 0
    for name, shape in params:
        size = item_size * torch.Size(shape).numel()
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += size
    return shards


def _random_weight(
    name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype, device: str | torch.device
) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(parameter_seed(seed, name))
    weight = torch.empty(shape, dtype=torch.float32, device=device)
    weight.normal_(0.0, _WEIGHT_STD, generator=generator)
    return weight.to(dtype)
