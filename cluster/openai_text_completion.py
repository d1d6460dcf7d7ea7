"""``/v1/completions``' answers: the whole completion, its chunks and usage chunk, and its logprobs in
OpenAI's legacy shape (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.cluster.openai_echo import EchoedPrompt
from kvserve.cluster.openai_prompt_logprobs import PromptLogprobs
from kvserve.cluster.openai_protocol import (
    ChoiceOutput,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionUsage,
)
from kvserve.cluster.openai_tokens import TokenNames
from kvserve.proto import generate_pb2


class CompletionLogprobsEncoder:
    """One completion's logprobs in the legacy shape, message by message (``text_offset`` runs on).

    ``echo``: the prompt the completion's text begins with.  Its tokens come in front of the first
    message's (``EchoedPrompt.prepend``, the first with null logprobs) when the request asks for
    logprobs; the completion's own offsets begin after its text.
    """

    def __init__(self, names: TokenNames, echo: EchoedPrompt | None = None) -> None:
        self._names = names
        self._offsets = names.text_offsets()
        self._echo = echo
        self._text_start = 0

    def encode(
        self, token_ids: Sequence[int], logprobs: Sequence[generate_pb2.TokenLogprobs | None]
    ) -> CompletionLogprobs:
        """``None`` logprobs (an echoed prompt's first token) are nulls."""
        text = self._names.text
        tokens = [text(token_id) for token_id in token_ids]
        text_offset: list[int] = []
        own_ids = token_ids
        echo, self._echo = self._echo, None
        if echo is not None:
            prompt_length = self._text_start = len(echo.text)
            if logprobs and logprobs[0] is None and echo.token_ids is not None:
                num_prompt_tokens = len(echo.token_ids)
                # NOTE: clamped: a text prompt is echoed as sent, and its ids' decoding may be shorter.
                prompt_offsets = self._names.text_offsets().of(token_ids[:num_prompt_tokens])
                text_offset = [min(offset, prompt_length) for offset in prompt_offsets]
                own_ids = token_ids[num_prompt_tokens:]
        text_offset += [self._text_start + offset for offset in self._offsets.of(own_ids)]
        top_logprobs: list[dict[str, float] | None] = []
        for token, token_logprobs in zip(tokens, logprobs, strict=True):
            if token_logprobs is None:
                top_logprobs.append(None)
                continue
            # Alternatives whose texts are the same (parts of characters: U+FFFD) keep the likeliest; the
            # sampled token's text keeps its own logprob, as token_logprobs gives it.
            top: dict[str, float] = {}
            for alternative in token_logprobs.top_logprobs:
                key = text(alternative.token_id)
                top[key] = max(top.get(key, alternative.logprob), alternative.logprob)
            top[token] = token_logprobs.logprob
            top_logprobs.append(top)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[None if token_logprobs is None else token_logprobs.logprob for token_logprobs in logprobs],
            top_logprobs=top_logprobs,
            text_offset=text_offset,
        )


class TextCompletionShape:
    """The messages of ``/v1/completions``: the whole completion, its chunks, its usage chunk."""

    def __init__(self, model: str, names: TokenNames) -> None:
        self.model = model
        self._names = names

    def logprobs_encoder(self, echo: EchoedPrompt | None = None) -> CompletionLogprobsEncoder:
        return CompletionLogprobsEncoder(self._names, echo)

    def whole(self, request_id: str, choices: Sequence[ChoiceOutput], usage: CompletionUsage) -> Completion:
        return Completion(
            id=f"cmpl-{request_id}",
            model=self.model,
            choices=[
                CompletionChoice(index=index, text=c.text, logprobs=c.logprobs, finish_reason=c.finish_reason,
                                 prompt_logprobs=c.prompt_logprobs)
                for index, c in enumerate(choices)
            ],
            usage=usage,
        )

    def chunk(
        self, request_id: str, created: int, index: int, text: str, reason: str | None, first: bool,
        logprobs: CompletionLogprobs | None = None, prompt_logprobs: PromptLogprobs | None = None,
    ) -> Completion | None:
        if not text and reason is None and logprobs is None and prompt_logprobs is None:
            return None
        choice = CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=reason, prompt_logprobs=prompt_logprobs
        )
        return Completion(id=f"cmpl-{request_id}", created=created, model=self.model, choices=[choice])

    def usage_chunk(self, request_id: str, created: int, usage: CompletionUsage) -> Completion:
        return Completion(id=f"cmpl-{request_id}", created=created, model=self.model, choices=[], usage=usage)
