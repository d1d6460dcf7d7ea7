"""Incremental detokenization on the tiny model's byte-level BPE tokenizer."""

from __future__ import annotations

import random

import pytest

from kvserve.cluster.detokenizer import IncrementalDetokenizer, decode_function

MULTI_BYTE_TEXT = "héllo wörld 日本語 🙂 done"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvserve.worker.tiny_model import ensure_default_tiny_model

    return AutoTokenizer.from_pretrained(ensure_default_tiny_model())


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _stream(tokenizer, token_ids: list[int], chunk: int = 1) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add(token_ids[i : i + chunk]) for i in range(0, len(token_ids), chunk)]
    pieces.append(detokenizer.flush())
    return pieces


def test_multi_byte_characters_are_spread_over_several_tokens(tokenizer):
    # The premise of the other tests: decoding a prefix of these ids shows U+FFFD.
    token_ids = _encode(tokenizer, MULTI_BYTE_TEXT)
    prefixes = [tokenizer.decode(token_ids[:n]) for n in range(1, len(token_ids))]
    assert any(prefix.endswith("\ufffd") for prefix in prefixes)


def test_pieces_never_contain_a_partial_character(tokenizer):
    pieces = _stream(tokenizer, _encode(tokenizer, MULTI_BYTE_TEXT))
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == MULTI_BYTE_TEXT


def test_a_character_is_held_back_until_its_last_byte_arrives(tokenizer):
    token_ids = _encode(tokenizer, "日")
    assert len(token_ids) > 1
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.add([t]) for t in token_ids] == [""] * (len(token_ids) - 1) + ["日"]


def test_pieces_are_the_text_added_since_the_previous_one(tokenizer):
    token_ids = _encode(tokenizer, "the cat sat on the mat")
    detokenizer = IncrementalDetokenizer(tokenizer)
    for n, token_id in enumerate(token_ids, start=1):
        before = tokenizer.decode(token_ids[: n - 1])
        assert detokenizer.add([token_id]) == tokenizer.decode(token_ids[:n])[len(before) :]


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_several_tokens_at_once_give_the_same_text(tokenizer, chunk):
    token_ids = _encode(tokenizer, MULTI_BYTE_TEXT)
    pieces = _stream(tokenizer, token_ids, chunk)
    assert "".join(pieces) == MULTI_BYTE_TEXT
    assert all("\ufffd" not in piece for piece in pieces)


def test_special_tokens_add_no_text(tokenizer):
    eos = tokenizer.eos_token_id
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add(_encode(tokenizer, "hi")) == "hi"
    assert detokenizer.add([eos]) == ""
    assert detokenizer.flush() == ""


def test_flush_returns_an_unfinished_character_as_replacement(tokenizer):
    token_ids = _encode(tokenizer, "a日")
    detokenizer = IncrementalDetokenizer(tokenizer)
    text = "".join(detokenizer.add([t]) for t in token_ids[:-1])
    assert text == "a"
    tail = detokenizer.flush()
    assert tail.endswith("\ufffd")
    assert text + tail == tokenizer.decode(token_ids[:-1])


def test_random_token_streams_concatenate_to_the_full_decode(tokenizer):
    rng = random.Random(0)
    vocab_size = tokenizer.vocab_size
    for _ in range(200):
        token_ids = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 40))]
        pieces = _stream(tokenizer, token_ids, chunk=rng.randrange(1, 4))
        assert "".join(pieces) == tokenizer.decode(token_ids, skip_special_tokens=True)
        # Random bytes may be invalid UTF-8 mid-stream, but no piece ends in a
        # sequence that a later token could still complete.
        assert not any(piece.endswith("\ufffd") for piece in pieces[:-1])


def test_the_fast_decode_function_gives_the_tokenizers_own_text(tokenizer):
    rng = random.Random(1)
    decode = decode_function(tokenizer)
    for _ in range(200):
        token_ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(0, 20))]
        assert decode(token_ids) == tokenizer.decode(token_ids, skip_special_tokens=True)
