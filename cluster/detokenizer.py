"""Incremental detokenization: the text one request's new tokens add.

Decoding tokens one by one does not work: with a byte-level tokenizer one
character may span several tokens (``日`` is three bytes, often three tokens),
and a decoder shows an incomplete sequence as U+FFFD.  So the detokenizer keeps
a small window of tokens and emits text only once it no longer ends in U+FFFD::

    ids        ... | emitted | window being read |
                   ^ prefix_offset   ^ read_offset
    text added = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

Every emitted boundary falls between complete characters, so the pieces
concatenate to ``tokenizer.decode(all ids)`` (once ``flush`` has been called).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

_REPLACEMENT_CHAR = "\ufffd"


def decode_function(tokenizer: Any, *, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=...)`` as a function of the ids alone.

    NOTE: transformers' ``decode`` converts and checks its input in Python,
    which costs several times the Rust decode it ends in; a streaming front end
    decodes twice per message.  When the tokenizer would not post-process the
    text (``clean_up_tokenization_spaces`` off), the Rust tokenizer is called
    directly: the text is the same.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        backend_decode = backend.decode
        return lambda ids: backend_decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, piece by piece.

    ``add(ids)`` returns the text that ``ids`` complete (possibly ``""`` while a
    multi-byte character is unfinished); ``flush()`` returns whatever is held
    back, at the end of the request.  Special tokens (EOS) add no text unless
    ``skip_special_tokens`` is false.
    """

    __slots__ = ("_decode", "_token_ids", "_prefix_offset", "_read_offset")

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self._decode = decode_function(tokenizer, skip_special_tokens=skip_special_tokens)
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_ids: Sequence[int]) -> str:
        """Append ``token_ids``; return the text they complete."""
        self._token_ids.extend(token_ids)
        prefix_text, text = self._decode_window()
        if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return text[len(prefix_text) :]

    def held(self) -> str:
        """The text held back now, as ``flush`` would return it, without flushing it."""
        if self._read_offset == len(self._token_ids):  # every token's text has been returned
            return ""
        prefix_text, text = self._decode_window()
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Return the text still held back (an unfinished character shows as U+FFFD)."""
        prefix_text, text = self._decode_window()
        self._prefix_offset = self._read_offset = len(self._token_ids)
        return text[len(prefix_text) :]

    def _decode_window(self) -> tuple[str, str]:
        ids = self._token_ids
        decode = self._decode
        prefix_text = ""
        if self._read_offset > self._prefix_offset:
            prefix_text = decode(ids[self._prefix_offset : self._read_offset])
        text = decode(ids[self._prefix_offset :])
        return prefix_text, text
