"""The vocabulary a generated workload draws its token ids from."""

from __future__ import annotations

from kvserve.scheduler.checks import check_ints

# Token ids are drawn from [3, vocab_size) as uint32 (ids 0-2 are special).
MIN_VOCAB_SIZE = 4
MAX_VOCAB_SIZE = 2**32


def check_vocab_size(vocab_size: object) -> None:
    """``ValueError`` unless ``vocab_size`` is an integer in [MIN_VOCAB_SIZE, MAX_VOCAB_SIZE]."""
    check_ints(MIN_VOCAB_SIZE, vocab_size=vocab_size)
    if vocab_size > MAX_VOCAB_SIZE:  # type: ignore[operator]
        raise ValueError(f"vocab_size must be at most {MAX_VOCAB_SIZE}, got {vocab_size!r}")
