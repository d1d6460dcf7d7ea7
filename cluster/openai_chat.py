"""``POST /v1/chat/completions``: its messages, and the rendering of a conversation with the model's chat template.

The conversation is rendered with the chat template (the tokenizer's own, or
``--chat-template FILE``) by ``kvserve.worker.chat_template``'s rule, which
``LLM.chat`` follows too.  The token ids then take the same pipeline as any
completion (``openai_protocol.to_generate_request``).

A message's ``name`` reaches the template as transformers' ``apply_chat_template``
passes it (``message['name']``, present only when given).  The messages' text
(contents and names) is bounded by ``--max-prompt-bytes`` before it is
rendered, as a completion's prompt is.  Without ``max_tokens`` (or
``max_completion_tokens``) the answer may take the rest of the context, as
OpenAI's and vLLM's do: it ends at EOS or at ``max_model_len``.

``logprobs: true`` (and ``top_logprobs: k``) gives each choice
``logprobs.content``: per token its text, log-probability, UTF-8 bytes and
the ``k`` most likely tokens in the same shape.  vLLM's ``prompt_logprobs: k``
comes once per answer, beside ``choices``, as vLLM gives it (``openai_prompt_logprobs``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_core import PydanticCustomError

from kvserve.cluster.frontend import FrontendError, InvalidRequestError
from kvserve.cluster.openai_echo import EchoedPrompt
from kvserve.cluster.openai_protocol import (
    REQUEST_CONFIG,
    ChoiceOutput,
    CompletionUsage,
    SamplingRequest,
    one_of,
)
from kvserve.cluster.openai_prompt_logprobs import PromptLogprobs
from kvserve.cluster.openai_tokens import TokenNames
from kvserve.proto import generate_pb2
from kvserve.scheduler.sampling_params import MAX_LOGPROBS
from kvserve.worker.chat_template import (
    ChatTemplateSyntaxError,
    check_chat_template,
    conversation_of,
    join_text_parts,
    render_conversation,
    template_of,
)

logger = logging.getLogger(__name__)

NO_TEMPLATE = (
    "messages: this model has no chat template; start the server with --chat-template FILE, "
    "or send the rendered prompt to /v1/completions"
)


class TextPart(BaseModel):
    model_config = REQUEST_CONFIG

    type: Literal["text"]
    text: str


Content = Annotated[str | list[TextPart], one_of('a string or a list of {"type": "text", "text": ...} parts')]


# What a conversation with tool calls has that others lack: the calls, and the answers' roles and ids.
_TOOL_CALLING_FIELDS = ("tool_calls", "tool_call_id", "function_call")
_TOOL_CALLING_ROLES = ("tool", "function")


class ChatMessage(BaseModel):
    model_config = REQUEST_CONFIG

    role: Literal["system", "developer", "user", "assistant"]
    content: Content
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_tool_calling(cls, data: Any) -> Any:
        """A message of tool calling is refused as such (not as an unknown field or role, or for the
        ``null`` content of an assistant message that calls tools); empty or null calls are none."""
        if not isinstance(data, dict):
            return data
        data = {key: value for key, value in data.items() if key not in _TOOL_CALLING_FIELDS or value not in (None, [])}
        used = [key for key in _TOOL_CALLING_FIELDS if key in data]
        if data.get("role") in _TOOL_CALLING_ROLES:
            used.insert(0, f"role {data['role']!r}")
        if used:
            raise PydanticCustomError(
                "tool_calling", "{used}: kvserve does not support tool calling yet", {"used": ", ".join(used)}
            )
        return data


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is the newer name of ``max_tokens``."""

    # Tools, structured output, audio and reasoning are not implemented: only their neutral values pass.
    NEUTRAL_VALUES: ClassVar[dict[str, tuple[Any, ...]]] = {
        **SamplingRequest.NEUTRAL_VALUES,
        "response_format": ({"type": "text"},),
        "tools": ([],),
        "tool_choice": ("none", "auto"),
        "functions": ([],),
        "function_call": ("none", "auto"),
        "modalities": (["text"],),
        "audio": (),
        "prediction": (),
        "reasoning_effort": (),
        "web_search_options": (),
        "verbosity": ("medium",),
        # vLLM's extras of chat.
        "add_generation_prompt": (True,),
        "continue_final_message": (False,),
        "chat_template_kwargs": ({},),
        "chat_template": (),
        "documents": (),
        "echo": (False,),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Without tools, whether they may be called in parallel changes nothing.
    parallel_tool_calls: bool | None = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template_kwargs: Any = None
    chat_template: Any = None
    documents: Any = None
    echo: Any = None

    @property
    def num_logprobs(self) -> int | None:
        """How many alternatives per token ``logprobs`` and ``top_logprobs`` ask for (``None``: no logprobs)."""
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise InvalidRequestError("top_logprobs: needs logprobs to be true")
            return None
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs: must be an integer in [0, {MAX_LOGPROBS}], got {self.top_logprobs}"
            )
        return self.top_logprobs or 0

    @property
    def max_tokens_field(self) -> str:
        """The name the request gave its limit of output tokens by, for errors about it."""
        only_new_name = self.max_tokens is None and self.max_completion_tokens is not None
        return "max_completion_tokens" if only_new_name else "max_tokens"

    @property
    def output_limit(self) -> int | None:
        """The limit of output tokens the request gives (``None``: none, the rest of the context)."""
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise InvalidRequestError("max_completion_tokens: differs from max_tokens; give one of them")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def rest_of_context(num_prompt_tokens: int, max_model_len: int) -> int:
    """The output limit of an answer that gives none: the context left after its prompt."""
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            f"messages: the conversation renders to {num_prompt_tokens} tokens, which leaves no room for an "
            f"answer in max_model_len {max_model_len}"
        )
    return max_model_len - num_prompt_tokens


def check_text_bytes(messages: list[ChatMessage], max_prompt_bytes: int) -> None:
    """``InvalidRequestError`` when the messages' text (contents and names) is over ``max_prompt_bytes``."""
    num_bytes = sum(len(_text(m.content).encode()) + len((m.name or "").encode()) for m in messages)
    if num_bytes > max_prompt_bytes:
        raise InvalidRequestError(
            f"messages: {num_bytes} bytes of text, over the limit of {max_prompt_bytes} (max_prompt_bytes)"
        )


def render_prompt(tokenizer: Any | None, template: str | None, messages: list[ChatMessage]) -> list[int]:
    """The token ids of ``messages`` as the template renders them, ready for the assistant's turn
    (``kvserve.worker.chat_template``'s rule).

    ``InvalidRequestError`` when there is no template, or it refuses the conversation; ``FrontendError``
    (a 500) when it does not compile.
    """
    if tokenizer is None:
        raise InvalidRequestError("messages: this model has no tokenizer: send token ids to /v1/completions")
    template = template_of(tokenizer, template)
    if not template:
        raise InvalidRequestError(NO_TEMPLATE)
    try:
        conversation = conversation_of([m.model_dump(exclude_none=True) for m in messages])
        return render_conversation(tokenizer, template, conversation)
    except ChatTemplateSyntaxError as exc:
        # NOTE: the server's fault, not the request's: a 500, and the details in the log (start-up warned).
        logger.error("a chat completion failed: %s", exc)
        raise FrontendError("the server's chat template does not compile") from None
    except ValueError as exc:
        raise InvalidRequestError(f"messages: {exc}") from None


def warn_of_a_broken_template(tokenizer: Any | None, template: str | None) -> None:
    """At start-up: a WARNING when the chat template to serve (``template``, else the tokenizer's own)
    does not compile, as every chat completion would then fail."""
    template = template_of(tokenizer, template) if tokenizer is not None else None
    if not template:
        return
    try:
        check_chat_template(template)
    except ChatTemplateSyntaxError as exc:
        logger.warning("/v1/chat/completions will answer every request with an error: %s", exc)


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else join_text_parts(part.text for part in content)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatLogprobsEncoder:
    """A chat answer's logprobs, message by message."""

    def __init__(self, names: TokenNames) -> None:
        self._names = names

    def encode(self, token_ids: Sequence[int], logprobs: Sequence[generate_pb2.TokenLogprobs]) -> ChatLogprobs:
        text, token_bytes = self._names.text, self._names.bytes
        content = []
        for token_id, token_logprobs in zip(token_ids, logprobs, strict=True):
            top = [
                TopLogprob(token=text(alternative.token_id), logprob=alternative.logprob,
                           bytes=token_bytes(alternative.token_id))
                for alternative in token_logprobs.top_logprobs
            ]
            content.append(
                TokenLogprob(token=text(token_id), logprob=token_logprobs.logprob, bytes=token_bytes(token_id),
                             top_logprobs=top)
            )
        return ChatLogprobs(content=content)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    # vLLM's: once, as every choice has the same prompt; left out unless the request asks.
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=lambda value: value is None)


class ChatDelta(BaseModel):
    # NOTE: left out of the chunks after a choice's first, as OpenAI's are, not sent as null.
    role: Literal["assistant"] | None = Field(default=None, exclude_if=lambda role: role is None)
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = None
    # On each choice's first chunk only, when the request asks for them.
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=lambda value: value is None)


class ChatCompletionShape:
    """The messages of ``/v1/chat/completions``: the whole answer, its chunks (each choice's first says the role)."""

    def __init__(self, model: str, names: TokenNames) -> None:
        self.model = model
        self._names = names

    def logprobs_encoder(self, echo: EchoedPrompt | None = None) -> ChatLogprobsEncoder:
        """``echo``: always ``None``, chat completions echo nothing."""
        return ChatLogprobsEncoder(self._names)

    def whole(self, request_id: str, choices: Sequence[ChoiceOutput], usage: CompletionUsage) -> ChatCompletion:
        return ChatCompletion(
            id=f"chatcmpl-{request_id}",
            model=self.model,
            choices=[
                ChatChoice(
                    index=index, message=AssistantMessage(content=c.text), logprobs=c.logprobs,
                    finish_reason=c.finish_reason,
                )
                for index, c in enumerate(choices)
            ],
            usage=usage,
            # NOTE: the first choice's that has them (one aborted before its first token has none).
            prompt_logprobs=next((c.prompt_logprobs for c in choices if c.prompt_logprobs is not None), None),
        )

    def chunk(
        self, request_id: str, created: int, index: int, text: str, reason: str | None, first: bool,
        logprobs: ChatLogprobs | None = None, prompt_logprobs: PromptLogprobs | None = None,
    ) -> ChatCompletionChunk | None:
        if not text and reason is None and not first and logprobs is None:
            return None
        delta = ChatDelta(role="assistant" if first else None, content=text)
        return ChatCompletionChunk(
            id=f"chatcmpl-{request_id}",
            created=created,
            model=self.model,
            choices=[ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason)],
            prompt_logprobs=prompt_logprobs,
        )

    def usage_chunk(self, request_id: str, created: int, usage: CompletionUsage) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=f"chatcmpl-{request_id}", created=created, model=self.model, choices=[], usage=usage
        )
