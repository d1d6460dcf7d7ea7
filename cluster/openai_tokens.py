"""How the OpenAI API names a token in logprobs: its text, its bytes, and where its text begins.

* **text**: the token decoded alone (``" what"``).  A token holding part of a character
  (byte-level tokenizers cut ``日``, three UTF-8 bytes, into up to three tokens) decodes to
  U+FFFD.
* **bytes** (chat logprobs): the token's own bytes, so that a client can join those of the
  tokens that together make one character, as OpenAI documents the field.  Not the text's
  UTF-8, which would give U+FFFD's three bytes for each part of a character (and, with
  SentencePiece's decoders, no leading space: ``"▁Hello"`` decodes alone to ``"Hello"``).
* **text offset** (legacy completions): where the token's text begins in the completion's
  text, so that ``text[text_offset[i]:]`` starts with what token ``i`` added.  A running sum
  of the tokens' own texts would drift wherever a token adds no text of its own or not its
  own: a special token (``<s>``, skipped in the text), each part of a character (U+FFFD
  alone, nothing in the text until the character is whole).  So the offsets come from the
  same incremental detokenization as the text: the parts of one character share its offset.

Without a tokenizer (token-id prompts only) a token is ``token_id:N``, its bytes those of
that name, and every offset 0: the text is empty.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from typing import Any

from kvserve.cluster.detokenizer import IncrementalDetokenizer

_BYTE_FALLBACK_PREFIX, _BYTE_FALLBACK_SUFFIX = "<0x", ">"  # SentencePiece's byte tokens: <0xE6>


class TokenNames:
    """One served model's token texts and bytes (cached), and text offsets for new completions."""

    def __init__(self, tokenizer: Any | None) -> None:
        self._tokenizer = tokenizer
        self.text: Callable[[int], str] = functools.lru_cache(maxsize=1 << 16)(self._text)
        self.bytes: Callable[[int], list[int]] = functools.lru_cache(maxsize=1 << 16)(self._bytes)
        decoders = _decoders(tokenizer)
        byte_level = any(node.get("type") == "ByteLevel" for node in decoders)
        self._byte_of_char = _byte_level_alphabet() if byte_level else None
        # SentencePiece's word mark (a Metaspace decoder, or a Replace of it by a space): a space in bytes.
        self._word_mark = next((mark for node in decoders if (mark := _word_mark(node)) is not None), None)

    def text_offsets(self) -> TextOffsets:
        """Offsets for one new completion's tokens, from 0."""
        return TextOffsets(self._tokenizer)

    def _text(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> list[int]:
        if self._tokenizer is None:
            return list(self._text(token_id).encode())
        to_piece = getattr(self._tokenizer, "convert_ids_to_tokens", None)
        piece = to_piece(token_id) if to_piece is not None else None
        if isinstance(piece, str):
            if self._byte_of_char is not None and all(char in self._byte_of_char for char in piece):
                return [self._byte_of_char[char] for char in piece]
            if piece.startswith(_BYTE_FALLBACK_PREFIX) and piece.endswith(_BYTE_FALLBACK_SUFFIX) and len(piece) == 6:
                try:
                    return [int(piece[3:5], 16)]
                except ValueError:
                    pass
            if self._word_mark is not None:
                # NOTE: not the decoded text, whose decoder strips a leading space ("▁Hello" -> "Hello").
                return list(piece.replace(self._word_mark, " ").encode())
        return list(self._text(token_id).encode())


class TextOffsets:
    """Where each of one completion's tokens begins in its text (message after message).

    A token that completes the text held back before it (the parts of a character) begins where that
    text does, and shares its offset.  But bytes that never become a character are held back until a
    later token shows it, and then stand in the text as U+FFFD in front of that token's own text: that
    token begins after them (their offset once gave it theirs, and every later offset was 1 short).
    Bytes held back together share the offset of the first (whether a later one is a character of its
    own shows only in hindsight: a byte-fallback decoder shows each part of a character as U+FFFD).
    """

    __slots__ = ("_detokenizer", "_length")

    def __init__(self, tokenizer: Any | None) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._length = 0

    def of(self, token_ids: Sequence[int]) -> list[int]:
        """The offsets of ``token_ids``, which follow the tokens given before."""
        if self._detokenizer is None:
            return [0] * len(token_ids)
        offsets = []
        for token_id in token_ids:
            held = self._detokenizer.held()
            added = self._detokenizer.add([token_id])
            after_held = held and len(added) > len(held) and added.startswith(held)
            offsets.append(self._length + (len(held) if after_held else 0))
            self._length += len(added)
        return offsets


def _decoders(tokenizer: Any | None) -> list[dict[str, Any]]:
    """The tokenizer's decoder and, for a sequence, the decoders in it (its JSON); none without one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return []
    stack, nodes = [json.loads(backend.to_str()).get("decoder") or {}], []
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.get("decoders") or ())
    return nodes


def _word_mark(decoder: dict[str, Any]) -> str | None:
    if decoder.get("type") == "Metaspace":
        return decoder.get("replacement") or None
    if decoder.get("type") == "Replace" and decoder.get("content") == " ":
        return (decoder.get("pattern") or {}).get("String") or None
    return None


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character of each byte, inverted: printable Latin-1 bytes are their own
    character, the others (controls, space, 0x7F-0xA0, 0xAD) take the characters from U+0100 on, in
    byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    byte_of_char = {chr(byte): byte for byte in printable}
    others = sorted(set(range(256)) - set(printable))
    for index, byte in enumerate(others):
        byte_of_char[chr(256 + index)] = byte
    return byte_of_char
