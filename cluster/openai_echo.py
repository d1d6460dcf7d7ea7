"""``echo: true`` on ``/v1/completions``: each choice's text, and its logprobs, begin with the prompt's.

As OpenAI's legacy completions API does it (lm-evaluation-harness scores a
continuation so: ``echo: true, logprobs: 1, max_tokens: 1``, then reads the
prompt tokens' logprobs)::

    prompt      "The cat"   (tokens "The", " cat")       completion  " sat"
    text            "The cat sat"
    tokens          ["The", " cat", " sat"]
    token_logprobs  [null,  -2.1,   -0.7]        nothing predicts the first prompt token
    top_logprobs    [null,  {...},  {...}]
    text_offset     [0,     3,      7]

The prompt's logprobs are the pipeline's (``GenerateResponse.prompt_logprobs``,
asked for with ``sampling_params.prompt_logprobs``: the request's ``logprobs``
alternatives, or its ``prompt_logprobs`` ones when more: the first ``logprobs``
are kept here), on each choice's first message.  They are named by the
prompt's token ids, so a text prompt that asks for logprobs is tokenized
before (``openai_prompt_logprobs.tokenized_prompt``) and sent as ids.  The
echoed text is a text prompt itself, or a token-id prompt decoded as a
completion's text is (special tokens skipped; ``""`` without a tokenizer, as
a completion's text is then).  Streamed, the prompt comes in each choice's
first chunk; with ``n`` choices each echoes it.

NOTE: the logprobs name every prompt token, a BOS the tokenizer added
included (as vLLM's do).  Its text (``"<s>"``) is not in the echoed text, so
its ``text_offset`` is the next token's: offsets are where each token's text
begins in the text (``openai_tokens``), not a sum of the tokens' own texts
(vLLM's, which shifts every later offset by the BOS's length).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.cluster.detokenizer import decode_function
from kvserve.proto import generate_pb2


class EchoedPrompt:
    """The prompt each choice of one prompt of a completion begins with: its text (``text``, or ``token_ids`` decoded),
    its token ids when known (a token-id prompt, or a text prompt tokenized for logprobs), and how many
    alternatives per token the request's ``logprobs`` ask for (``None``: no logprobs)."""

    __slots__ = ("_text", "token_ids", "num_logprobs", "_tokenizer")

    def __init__(
        self, text: str | None, token_ids: Sequence[int] | None, *, num_logprobs: int | None, tokenizer: Any | None
    ) -> None:
        self._text = text
        self.token_ids = tuple(token_ids) if token_ids is not None else None
        self.num_logprobs = num_logprobs
        self._tokenizer = tokenizer

    @property
    def text(self) -> str:
        """The prompt's text; a token-id prompt's is decoded on first use, once the pipeline has validated
        its ids."""
        if self._text is None:
            ids = self.token_ids
            self._text = "" if self._tokenizer is None or ids is None else decode_function(self._tokenizer)(list(ids))
        return self._text

    def prepend(
        self,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[generate_pb2.TokenLogprobs | None],
        prompt_logprobs: Sequence[generate_pb2.TokenLogprobs],
    ) -> tuple[str, Sequence[int], Sequence[generate_pb2.TokenLogprobs | None]]:
        """A choice's first chunk (or whole completion) with the prompt in front: its text, and, where the
        request asks for logprobs, its tokens and their logprobs (``None`` for the first token's).

        ``prompt_logprobs``: the choice's first message's, one per prompt token after the first.
        """
        text = self.text + text
        ids, num_top = self.token_ids, self.num_logprobs
        # NOTE: a choice whose first message is an abort (no token yet) has none to put in front.
        if num_top is None or ids is None or len(prompt_logprobs) != len(ids) - 1:
            return text, token_ids, logprobs
        return text, [*ids, *token_ids], [None, *(_at_most(p, num_top) for p in prompt_logprobs), *logprobs]


def _at_most(logprobs: generate_pb2.TokenLogprobs, num_top: int) -> generate_pb2.TokenLogprobs:
    """``logprobs`` with its ``num_top`` likeliest alternatives (the pipeline may have been asked for more,
    for ``prompt_logprobs``)."""
    if len(logprobs.top_logprobs) <= num_top:
        return logprobs
    return generate_pb2.TokenLogprobs(logprob=logprobs.logprob, top_logprobs=logprobs.top_logprobs[:num_top])


def echoed_prompt(
    prompt: str | list[int], token_ids: Sequence[int] | None, echo: bool, logprobs: int | None, tokenizer: Any | None
) -> EchoedPrompt | None:
    """What each choice of ``prompt`` echoes (``None`` without ``echo``): ``prompt`` as the request gave
    it, ``token_ids`` its ids when known (``tokenized_prompt``)."""
    if not echo:
        return None
    text = prompt if isinstance(prompt, str) else None
    return EchoedPrompt(text, token_ids, num_logprobs=logprobs, tokenizer=tokenizer)
