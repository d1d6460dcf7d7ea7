"""How logprobs name tokens: their bytes and text offsets, on the tiny model's byte-level BPE tokenizer
(parts of characters, a BOS in the middle) and on a SentencePiece-style one with byte fallback."""

from __future__ import annotations

import pytest

from kvserve.cluster.openai_echo import EchoedPrompt
from kvserve.cluster.openai_text_completion import CompletionLogprobsEncoder
from kvserve.cluster.openai_tokens import TokenNames
from kvserve.proto import generate_pb2

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvserve.worker.tiny_model import ensure_default_tiny_model

    return AutoTokenizer.from_pretrained(ensure_default_tiny_model())


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_parts_of_a_character_carry_its_bytes_not_the_replacement_characters(tokenizer):
    names = TokenNames(tokenizer)
    ids = ids_of(tokenizer, "日本 is")
    parts = [i for i in ids if names.text(i) == REPLACEMENT]
    assert len(parts) >= 2  # the tiny tokenizer cuts the characters into bytes

    assert b"".join(bytes(names.bytes(i)) for i in ids) == "日本 is".encode()
    for token_id in ids:
        if token_id not in parts:
            assert names.bytes(token_id) == list(names.text(token_id).encode())
    assert names.bytes(tokenizer.bos_token_id) == list(b"<s>")


def test_text_offsets_follow_the_text_through_parts_of_characters_and_special_tokens(tokenizer):
    names = TokenNames(tokenizer)
    ids = [*ids_of(tokenizer, " what"), tokenizer.bos_token_id, *ids_of(tokenizer, " 日本 is it")]
    text = tokenizer.decode(ids, skip_special_tokens=True)

    offsets = names.text_offsets().of(ids)

    assert len(offsets) == len(ids) and offsets[0] == 0 and offsets == sorted(offsets)
    for token_id, offset, end in zip(ids, offsets, [*offsets[1:], len(text)], strict=True):
        piece = names.text(token_id)
        if token_id == tokenizer.bos_token_id:
            assert offset == end  # skipped in the text: it adds nothing
        elif piece != REPLACEMENT:
            assert text[offset:end] == piece
    # The parts of each character share its offset; the character is one in the text.
    assert text[offsets[ids.index(tokenizer.bos_token_id) + 1]:].startswith(" 日本 is it")
    assert offsets[-1] == len(text) - len(names.text(ids[-1]))


def test_a_token_after_bytes_that_never_become_a_character_begins_after_their_replacement_character(tokenizer):
    # A sampled byte that starts a character the next token does not finish: the text shows U+FFFD
    # for it, in front of the next token's text, once that token comes.
    names = TokenNames(tokenizer)
    first_byte = next(i for i in ids_of(tokenizer, "日") if names.text(i) == REPLACEMENT)
    ids = [*ids_of(tokenizer, " what"), first_byte, *ids_of(tokenizer, " make it"), first_byte, first_byte,
           *ids_of(tokenizer, " is")]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert text == f" what{REPLACEMENT} make it{REPLACEMENT}{REPLACEMENT} is"

    offsets = names.text_offsets().of(ids)

    # Bytes held back together share the first's offset: whether the second is a character of its own
    # shows only in hindsight.
    assert offsets == [0, 5, 6, 11, 14, 14, 16]
    for token_id, offset in zip(ids, offsets, strict=True):
        assert text[offset:].startswith(names.text(token_id))


def test_offsets_given_message_by_message_are_those_of_the_whole(tokenizer):
    ids = ids_of(tokenizer, "héllo wörld 日本語 🙂 done")
    whole = TokenNames(tokenizer).text_offsets().of(ids)

    streamed = TokenNames(tokenizer).text_offsets()
    pieces = [streamed.of(ids[i : i + 3]) for i in range(0, len(ids), 3)]

    assert [offset for piece in pieces for offset in piece] == whole


def logprobs_of(token_id: int, logprob: float, alternatives: list[tuple[int, float]]) -> generate_pb2.TokenLogprobs:
    return generate_pb2.TokenLogprobs(
        logprob=logprob,
        top_logprobs=[generate_pb2.TopLogprob(token_id=i, logprob=lp) for i, lp in alternatives],
    )


def test_echoed_offsets_run_over_the_prompt_as_sent_then_the_completion(tokenizer):
    names = TokenNames(tokenizer)
    prompt_ids = [tokenizer.bos_token_id, *ids_of(tokenizer, "Once upon")]
    completion_ids = ids_of(tokenizer, " a time")
    echo = EchoedPrompt("Once upon", prompt_ids, num_logprobs=1, tokenizer=tokenizer)
    lp = [logprobs_of(i, -1.0, [(i, -1.0)]) for i in [*prompt_ids[1:], *completion_ids]]

    encoder = CompletionLogprobsEncoder(names, echo)
    first = encoder.encode([*prompt_ids, *completion_ids[:1]], [None, *lp[: len(prompt_ids)]])
    rest = encoder.encode(completion_ids[1:], lp[len(prompt_ids):])

    text = "Once upon a time"
    offsets = first.text_offset + rest.text_offset
    tokens = first.tokens + rest.tokens
    assert offsets[0] == offsets[1] == 0  # the BOS is not in the text
    for token, offset in zip(tokens[1:], offsets[1:], strict=True):
        assert text[offset:].startswith(token)


def test_alternatives_with_the_same_text_keep_the_likeliest_and_the_sampled_token_its_own(tokenizer):
    names = TokenNames(tokenizer)
    parts = [i for i in ids_of(tokenizer, "日本語🙂") if names.text(i) == REPLACEMENT][:3]
    sampled, likelier, unlikelier = parts
    word = ids_of(tokenizer, " what")[0]
    logprobs = logprobs_of(sampled, -2.0, [(word, -0.5), (likelier, -1.0), (sampled, -2.0), (unlikelier, -3.0)])

    [top] = CompletionLogprobsEncoder(names).encode([sampled], [logprobs]).top_logprobs

    assert top == {names.text(word): -0.5, REPLACEMENT: -2.0}  # what token_logprobs says of the sampled one
    logprobs = logprobs_of(word, -0.5, [(word, -0.5), (unlikelier, -3.0), (likelier, -1.0)])
    [top] = CompletionLogprobsEncoder(names).encode([word], [logprobs]).top_logprobs
    assert top == {names.text(word): -0.5, REPLACEMENT: -1.0}


def test_a_sentencepiece_byte_fallback_token_is_its_byte():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁a": 1, "<0xE6>": 2, "<0x97>": 3, "<0xA5>": 4}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    # Mistral's and Llama 2's decoders: the word mark a space, byte tokens, and the first space stripped.
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    names = TokenNames(tokenizer)

    assert [names.bytes(i) for i in (2, 3, 4)] == [[0xE6], [0x97], [0xA5]]
    assert b"".join(bytes(names.bytes(i)) for i in (2, 3, 4)).decode() == "日"
    assert (names.text(1), names.bytes(1)) == ("a", list(b" a"))  # the token's bytes keep its space
    assert names.text_offsets().of([1, 2, 3, 4, 1]) == [0, 1, 1, 1, 2]  # the text: "a日 a"


def test_a_metaspace_decoders_word_mark_is_a_space_in_bytes():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab={"<unk>": 0, "▁Hello": 1, "▁world": 2}, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    names = TokenNames(PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>"))

    assert [names.bytes(i) for i in (1, 2)] == [list(b" Hello"), list(b" world")]


def test_without_a_tokenizer_tokens_are_named_by_id_and_the_empty_text_has_offsets_0():
    names = TokenNames(None)

    assert names.text(7) == "token_id:7"
    assert names.bytes(7) == list(b"token_id:7")
    assert names.text_offsets().of([7, 8]) == [0, 0]
