"""Which tokens' logprobs a choice cut by a stop string sends: those whose text it (partly) keeps.

The front end ends a choice at the token that completes a stop string and
cuts its text where the stop string starts; so the last tokens may have no
text left, and, while the stop string is being matched, a token's text may be
held back::

    tokens:  " what"  " stay"  " bec"       stop: "y bec"
    text:    " what"  " sta"   (cut)        sent: " what sta"
    kept:    yes      yes      no

A token is kept once some of its text is sent, and dropped when the choice
ends without sending any of it, so the logprobs line up with the text,
streamed or whole.  A token's place in the text is where the front end's
incremental detokenization put its text (several tokens of one character
share the character's place).  A choice that ends without a stop string's cut
keeps every token (an EOS adds no text and is kept).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.cluster.detokenizer import IncrementalDetokenizer
from kvserve.proto import generate_pb2


class KeptTokens:
    """One choice's tokens and logprobs, released as its text is (``add``, message by message)."""

    def __init__(self, tokenizer: Any) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._num_chars = 0  # the text of the tokens seen, uncut
        self._num_sent = 0  # the text sent
        # Each token not yet released: where its text starts, its id and its logprobs.
        self._held: list[tuple[int, int, generate_pb2.TokenLogprobs]] = []

    def add(
        self, response: generate_pb2.GenerateResponse
    ) -> tuple[Sequence[int], Sequence[generate_pb2.TokenLogprobs]]:
        """The token ids and logprobs to send with ``response``: those whose text has begun to be sent."""
        for token_id, logprobs in zip(response.token_ids, response.logprobs, strict=True):
            self._held.append((self._num_chars, token_id, logprobs))
            self._num_chars += len(self._detokenizer.add([token_id]))
        self._num_sent += len(response.text)
        if response.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED:
            released = [held for held in self._held if held[0] < self._num_sent]  # a prefix: starts only grow
            self._held = self._held[len(released) :]
        else:
            self._num_chars += len(self._detokenizer.flush())
            is_cut = self._num_chars > self._num_sent
            released = [held for held in self._held if held[0] < self._num_sent] if is_cut else self._held
            self._held = []
        return [token_id for _, token_id, _ in released], [logprobs for _, _, logprobs in released]


def kept_tokens(generate: generate_pb2.GenerateRequest, tokenizer: Any | None) -> KeptTokens | None:
    """A ``KeptTokens`` for a choice that asks for logprobs and may be cut by a stop string, else ``None``."""
    params = generate.sampling_params
    if tokenizer is None or not params.stop or not params.HasField("logprobs"):
        return None
    return KeptTokens(tokenizer)
