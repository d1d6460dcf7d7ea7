"""The tokenizer of a model directory, when it has one."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: str | Path) -> Any | None:
    """The directory's Hugging Face tokenizer, or ``None`` when it ships none (token-id prompts only)."""
    path = Path(model_dir)
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    # NOTE: callers check prompt lengths against the served max_model_len
    # themselves; the tokenizer's own limit only made it log a warning
    # ("Token indices sequence length is longer than ...") for every prompt
    # past it, which a client could send at will.
    tokenizer.model_max_length = sys.maxsize
    return tokenizer
