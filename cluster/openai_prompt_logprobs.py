"""vLLM's ``prompt_logprobs: k`` extension of ``/v1/completions`` and ``/v1/chat/completions``.

Each prompt token's log-probability given the tokens before it, and the ``k``
(at most 20) likeliest tokens at its position, in vLLM's shape (its
``CompletionResponseChoice.prompt_logprobs`` and
``ChatCompletionResponse.prompt_logprobs``)::

    "prompt_logprobs": [
        null,                                                   nothing predicts the first token
        {"1014": {"logprob": -7.1, "rank": null, "decoded_token": " cat"},    the prompt's token first,
         "262":  {"logprob": -1.2, "rank": 1, "decoded_token": " the"}},      then the k likeliest
        ...
    ]

Keys are token ids as strings (JSON's keys are); a prompt token that is one of
the ``k`` appears once.  ``rank`` is 1-based among the vocabulary: the ``k``
likeliest are ranked 1 to ``k``; the prompt's own token has its rank when it is
one of them (or of the more the pipeline was asked for, beside ``echo``), else
``null``: the engine returns the top ``k`` only, so it is known to rank below
``k`` but not where (vLLM's ``Logprob.rank`` is nullable).

Completions carry them per choice, chat completions once per answer (at the top
level, beside ``choices``), as vLLM does.  Streamed, they come in each choice's
first chunk (vLLM refuses ``prompt_logprobs`` with ``stream: true``; a stream
here carries what the whole answer would).  They are the pipeline's
(``GenerateResponse.prompt_logprobs``), named by the prompt's token ids, so a
text prompt that asks for them is tokenized here once and sent as ids
(``tokenized_prompt``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel

from kvserve.cluster.frontend import InvalidRequestError
from kvserve.proto import generate_pb2
from kvserve.scheduler.sampling_params import MAX_LOGPROBS


class PromptLogprob(BaseModel):
    """One token's entry at one prompt position: vLLM's ``Logprob``."""

    logprob: float
    rank: int | None
    decoded_token: str


# One entry per prompt token: None for the first, then token id (a decimal string) -> its entry.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


def check_num_prompt_logprobs(num_top: int | None) -> int | None:
    """``prompt_logprobs`` checked: ``InvalidRequestError`` naming it when it is not in [0, ``MAX_LOGPROBS``]."""
    if num_top is not None and not 0 <= num_top <= MAX_LOGPROBS:
        raise InvalidRequestError(f"prompt_logprobs: must be an integer in [0, {MAX_LOGPROBS}], got {num_top}")
    return num_top


class PromptLogprobsEncoder:
    """One request's prompt logprobs in vLLM's shape: ``token_ids`` is its prompt, ``num_top`` its ``k``
    (the pipeline may have been asked for more alternatives, for ``echo``: the first ``k`` are kept)."""

    def __init__(self, token_ids: Sequence[int], num_top: int, token_text: Callable[[int], str]) -> None:
        self._token_ids = token_ids
        self._num_top = num_top
        self._token_text = token_text

    def encode(self, prompt_logprobs: Sequence[generate_pb2.TokenLogprobs]) -> PromptLogprobs | None:
        """``prompt_logprobs``: a choice's first message's, one per prompt token after the first; ``None`` when
        there are none for this prompt (a choice aborted before its first token)."""
        token_ids = self._token_ids
        if not token_ids or len(prompt_logprobs) != len(token_ids) - 1:
            return None
        token_text = self._token_text
        encoded: PromptLogprobs = [None]
        for token_id, token_logprobs in zip(token_ids[1:], prompt_logprobs, strict=True):
            alternatives = token_logprobs.top_logprobs
            rank = next((i for i, a in enumerate(alternatives, 1) if a.token_id == token_id), None)
            top = alternatives[: self._num_top]
            entry = {str(token_id): PromptLogprob(logprob=token_logprobs.logprob, rank=rank,
                                                  decoded_token=token_text(token_id))}
            for i, alternative in enumerate(top, 1):
                key = str(alternative.token_id)
                if key not in entry:
                    entry[key] = PromptLogprob(
                        logprob=alternative.logprob, rank=i, decoded_token=token_text(alternative.token_id)
                    )
            encoded.append(entry)
        return encoded


async def tokenized_prompt(
    prompt: str | list[int], tokenizer: Any | None, max_prompt_bytes: int, *, tokenize: bool
) -> tuple[str | list[int], list[int] | None]:
    """The prompt to send the pipeline, and its token ids: a token-id prompt's own; with ``tokenize``, a text
    prompt's, tokenized here (as the pipeline would: ``tokenizer(text)``) and sent as ids.

    ``None`` ids for a text prompt that the pipeline would refuse untokenized (empty, over
    ``max_prompt_bytes``, no tokenizer): it is sent as it is, to be refused so.
    """
    if isinstance(prompt, list):
        return prompt, prompt
    if not tokenize or tokenizer is None or not prompt or len(prompt.encode()) > max_prompt_bytes:
        return prompt, None
    # NOTE: a thread, as the pipeline tokenizes long prompts: on the event loop it would stall every stream.
    text = prompt
    token_ids = await asyncio.to_thread(lambda: list(tokenizer(text)["input_ids"]))
    return token_ids, token_ids
