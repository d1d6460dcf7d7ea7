"""Build a model from a Hugging Face directory and load this rank's shard of its weights.

Each rank opens every ``*.safetensors`` file lazily and hands each parameter's
``weight_loader`` a slice object (``safe_open(...).get_slice(name)``); the loader
narrows it to the rank's shard, so a rank reads only the bytes it keeps.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig

from kvserve.kernels import AttentionBackend, get_attention_backend
from kvserve.worker.distributed import TensorParallelGroup
from kvserve.worker.layers.embedding import DEFAULT_VOCAB_PARALLEL
from kvserve.worker.model_config import sliding_window_of
from kvserve.worker.models.registry import get_model_class

logger = logging.getLogger(__name__)

# Checkpoint entries that are not weights (buffers some older checkpoints saved).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def check_sliding_window(config: Any, max_model_len: int | None = None) -> None:
    """ValueError when the config's sliding window is shorter than the longest sequence
    (``max_model_len``, default the config's ``max_position_embeddings``): the paged
    attention here is full causal, which would be silently wrong past the window."""
    window = sliding_window_of(config)
    longest = max_model_len or config.max_position_embeddings
    if window is not None and window < longest:
        raise ValueError(
            f"sliding_window={window} < max_model_len={longest} is not supported (attention is full causal); "
            f"serve at most {window} tokens per sequence"
        )


def load_model(
    model_dir: str | Path,
    tp: TensorParallelGroup,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attention_backend: AttentionBackend | None = None,
    vocab_parallel: bool = DEFAULT_VOCAB_PARALLEL,
    max_model_len: int | None = None,
) -> nn.Module:
    """The model in ``model_dir`` (``config.json`` + ``*.safetensors``) built for rank
    ``tp.rank`` of ``tp.world_size``, in eval mode, parameters in ``dtype`` on ``device``.

    ``attention_backend`` defaults to ``get_attention_backend(device)``;
    ``vocab_parallel`` shards the embedding and LM head by vocabulary (else replicated).
    ``max_model_len`` is the longest sequence it will see (default the config's
    ``max_position_embeddings``).  Raises ValueError for an unsupported architecture or
    config (a sliding window shorter than ``max_model_len``), and for missing,
    unexpected or wrongly shaped weights.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    config = AutoConfig.from_pretrained(model_dir)
    model_cls = get_model_class(config)
    check_sliding_window(config, max_model_len)
    backend = attention_backend or get_attention_backend(device)
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(config, tp, backend, vocab_parallel=vocab_parallel)
    load_weights(model, model_dir)
    logger.info("loaded %s from %s as rank %d of %d", model_cls.__name__, model_dir, tp.rank, tp.world_size)
    return model.eval()


def _checkpoint_to_param(name: str, packed: dict[str, tuple[str, str | int]]) -> tuple[str, Any]:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``(model.layers.0.self_attn.qkv_proj.weight, "q")``."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in packed:
        target, shard_id = packed[parts[-2]]
        return ".".join([*parts[:-2], target, parts[-1]]), shard_id
    return name, None


def _expected_shards(param_name: str, packed: dict[str, tuple[str, str | int]]) -> set[Any]:
    module = param_name.split(".")[-2] if "." in param_name else ""
    shards = {shard_id for target, shard_id in packed.values() if target == module}
    return shards or {None}


# transformers' name for the index of a sharded safetensors checkpoint.
SAFETENSORS_INDEX = "model.safetensors.index.json"


def _weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of ``model_dir``: those its index names, else all of them."""
    index_path = model_dir / SAFETENSORS_INDEX
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index_path} is not a safetensors index (a weight_map of files): {exc}") from None
        files = [model_dir / name for name in names]
        missing = [name for name, path in zip(names, files) if not path.is_file()]
        if missing:
            raise ValueError(f"{index_path} names files that are not in {model_dir}: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    return files


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Fill every parameter of ``model`` from the ``*.safetensors`` files in ``model_dir``.

    With a ``model.safetensors.index.json``, only the files its ``weight_map``
    names are read, as transformers does: Mistral's repositories also ship
    ``consolidated.safetensors``, the same weights under Mistral's own names.
    All names are checked before any tensor is read: a checkpoint entry with no
    parameter, or a parameter (or shard of a packed one) with no entry, is a ValueError.
    """
    files = _weight_files(Path(model_dir))
    packed: dict[str, tuple[str, str | int]] = getattr(model, "packed_modules_mapping", {})
    tied = bool(getattr(model, "tie_word_embeddings", False))
    params = dict(model.named_parameters())

    plan: dict[Path, list[tuple[str, str, Any]]] = {}
    loaded: dict[str, set[Any]] = {name: set() for name in params}
    unexpected: list[str] = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
        for name in names:
            if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                continue
            param_name, shard_id = _checkpoint_to_param(name, packed)
            if param_name not in params:
                unexpected.append(name)
                continue
            if shard_id in loaded[param_name]:
                raise ValueError(f"weight {name} appears more than once in {model_dir}")
            loaded[param_name].add(shard_id)
            plan.setdefault(path, []).append((name, param_name, shard_id))
    if unexpected:
        raise ValueError(f"unexpected weights in {model_dir}: {sorted(unexpected)}")
    missing = [
        f"{name} (shards {sorted(map(str, _expected_shards(name, packed) - got))})"
        for name, got in loaded.items()
        if _expected_shards(name, packed) - got
    ]
    if missing:
        raise ValueError(f"missing weights in {model_dir}: {missing}")

    for path, entries in plan.items():
        with safe_open(path, framework="pt") as f:
            for name, param_name, shard_id in entries:
                param = params[param_name]
                try:
                    param.weight_loader(param, f.get_slice(name), shard_id)
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from exc
