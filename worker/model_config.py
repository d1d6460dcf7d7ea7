"""What the control plane and the front end need to know about a model directory."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


def _as_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)  # type: ignore[union-attr]


def sliding_window_of(hf_config: object) -> int | None:
    """The sliding attention window of ``hf_config`` in tokens; ``None`` when every layer attends fully."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window) if window is not None else None


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A Hugging Face model directory, as seen by the scheduler and the front end.

    ``model_id`` names the model in block hashes: the architecture and a digest
    of ``config.json``, so copies of one model hash alike and models of other
    shapes never do.  The weights are not read (a checkpoint can be tens of GB):
    two fine-tunes of one base model share an id, which is harmless within one
    cluster, since every replica serves the same model.
    """

    model_dir: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    model_id: str
    # What tensor parallelism splits (see ``check_tensor_parallel_size``); 0 where the config has none.
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    intermediate_size: int = 0
    # Why ``max_model_len`` is below the model's own limit when nobody asked for it; None when it is not.
    max_model_len_cap: str | None = None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, max_model_len: int | None = None) -> ModelConfig:
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"{model_dir} is not a model directory: config.json is missing")
        # NOTE: imported here, not at the top: transformers brings torch (2.3 s, hundreds of MB),
        # and the scheduler actor, which receives a ModelConfig and never reads a directory, needs neither.
        from transformers import AutoConfig

        try:
            hf = AutoConfig.from_pretrained(path)
        except Exception as exc:  # noqa: BLE001 - transformers' own errors: OSError, its validation errors
            # NOTE: a config.json that is not JSON was an OSError, one that
            # fails transformers' checks (heads that do not divide the hidden
            # size) its own exception type: callers expect a ValueError.
            raise ValueError(f"{model_dir}: config.json cannot be read: {str(exc).splitlines()[0]}") from exc
        num_layers = getattr(hf, "num_hidden_layers", None)
        if num_layers is not None and int(num_layers) < 1:
            # NOTE: it got as far as sizing the KV cache, and failed there dividing by zero bytes per block.
            raise ValueError(
                f"{model_dir}: config has num_hidden_layers={num_layers}; a model needs at least one layer"
            )
        limit = int(getattr(hf, "max_position_embeddings", 0) or 0)
        window = sliding_window_of(hf)
        cap = None
        if max_model_len is None:
            if limit <= 0:
                raise ValueError(f"{model_dir}: config has no max_position_embeddings; pass max_model_len")
            # NOTE: attention here is full causal, which equals a sliding window's
            # on sequences no longer than the window (Mistral 7B v0.1: 4096 tokens).
            max_model_len = min(limit, window) if window else limit
            if max_model_len < limit:
                cap = (f"capped to the model's sliding window of {window} tokens: attention here is full causal, "
                       "which equals a sliding window's only on sequences no longer than it")
                # NOTE: a warning, not an error: the model serves correctly, but prompts past the window that
                # the config's max_position_embeddings promises are refused, which should not surprise anyone.
                logger.warning(
                    "%s: max_model_len=%d, not max_position_embeddings=%d: context %s",
                    model_dir, max_model_len, limit, cap,
                )
        elif max_model_len < 1 or (limit and max_model_len > limit):
            raise ValueError(f"max_model_len must be in [1, {limit}], got {max_model_len}")
        elif window and max_model_len > window:
            raise ValueError(
                f"max_model_len must be at most the model's sliding window of {window} tokens, got "
                f"{max_model_len}: attention here is full causal, which differs from a sliding window's on longer "
                "sequences"
            )
        eos = set(_as_ids(getattr(hf, "eos_token_id", None)))
        generation_config = path / "generation_config.json"
        if generation_config.is_file():
            eos.update(_as_ids(json.loads(generation_config.read_text()).get("eos_token_id")))
        architectures = getattr(hf, "architectures", None) or ["unknown"]
        digest = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()[:16]
        return cls(
            model_dir=str(path),
            architecture=architectures[0],
            vocab_size=int(hf.vocab_size),
            max_model_len=int(max_model_len),
            eos_token_ids=tuple(sorted(eos)),
            model_id=f"{architectures[0]}:{digest}",
            num_attention_heads=int(getattr(hf, "num_attention_heads", 0) or 0),
            num_key_value_heads=int(
                getattr(hf, "num_key_value_heads", None) or getattr(hf, "num_attention_heads", 0) or 0
            ),
            intermediate_size=int(getattr(hf, "intermediate_size", 0) or 0),
            max_model_len_cap=cap,
        )

    def check_tensor_parallel_size(self, tp_size: int) -> None:
        """``ValueError`` unless ``tp_size`` ranks can split the model as the workers do.

        Each rank takes an equal share of the attention heads and of the MLP's
        intermediate size; of the KV heads too, or, with more ranks than KV
        heads, one replicated KV head each (so the ranks must be a multiple of
        them).  Checked before any worker starts: a worker finds out only after
        its process (or Ray actor) has started, seconds to a minute later.
        """
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp_size!r}")
        problems = []
        if self.num_attention_heads % tp_size:
            problems.append(f"the {self.num_attention_heads} attention heads")
        kv_heads = self.num_key_value_heads
        if kv_heads and (tp_size % kv_heads if tp_size >= kv_heads else kv_heads % tp_size):
            problems.append(f"the {kv_heads} KV heads (or be a multiple of them)")
        if self.intermediate_size % tp_size:
            problems.append(f"the MLP's intermediate size {self.intermediate_size}")
        if problems:
            raise ValueError(
                f"tensor_parallel_size {tp_size} cannot split the model in {self.model_dir}: "
                f"it must divide {' and '.join(problems)}"
            )
