"""A conversation rendered with a model's chat template, as token ids ready for the assistant's turn.

One rule for the in-process ``LLM.chat`` and the server's ``/v1/chat/completions``: the
template (the tokenizer's own unless another is given) renders the messages to text with
the generation prompt appended, and the text is tokenized without adding special
tokens, since a template writes the ones it wants (``{{ bos_token }}``) and the
tokenizer adding a BOS of its own would double it.

A message is ``{"role": str, "content": str}`` (OpenAI's list of ``{"type": "text", "text":
...}`` parts is joined into one string, a line each), with an optional ``"name"``, which reaches the
template only when given, as transformers' ``apply_chat_template`` passes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Conversation = list[dict[str, str]]


class ChatTemplateSyntaxError(ValueError):
    """A chat template that does not compile: the fault of whoever chose the template, never of a
    conversation rendered with it."""


def check_chat_template(template: str) -> None:
    """``ChatTemplateSyntaxError`` naming the line, unless ``template`` compiles as transformers
    compiles it to render (its Jinja environment and extensions)."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateSyntaxError(f"the chat template does not compile: line {exc.lineno}: {exc.message}") from None


def conversation_of(messages: Sequence[Mapping[str, Any]]) -> Conversation:
    """``messages`` as a template reads them; ``ValueError`` naming the first malformed one."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(f"a conversation must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ValueError("a conversation must have at least one message")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {type(message).__name__}")
        unknown = sorted(set(message) - {"role", "content", "name"})
        if unknown:
            raise ValueError(f"message {i} has unknown keys {unknown} (allowed: role, content, name)")
        role, name = message.get("role"), message.get("name")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {i}: 'role' must be a non-empty string, got {role!r}")
        rendered = {"role": role, "content": _text(message.get("content"), i)}
        if name is not None:
            if not isinstance(name, str):
                raise ValueError(f"message {i}: 'name' must be a string, got {name!r}")
            rendered["name"] = name
        conversation.append(rendered)
    return conversation


def template_of(tokenizer: Any, template: str | None) -> str | None:
    """``template`` if given, else the tokenizer's own chat template; ``None`` when it has none."""
    return template or getattr(tokenizer, "chat_template", None) or None


def render_conversation(tokenizer: Any, template: str, conversation: Conversation) -> list[int]:
    """The token ids of ``conversation`` as ``template`` renders it, ready for the assistant's turn.

    ``ValueError`` when the template refuses the conversation (its ``raise_exception``, or a
    type error inside it); ``ChatTemplateSyntaxError`` when it does not compile.
    """
    check_chat_template(template)
    try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # noqa: BLE001 - jinja's errors (raise_exception in a template) and type errors
        raise ValueError(f"the chat template refused them: {exc}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def join_text_parts(texts: Iterable[str]) -> str:
    """A message's text parts as its one string: a line each, as vLLM joins them for a template
    that reads strings."""
    return "\n".join(texts)


def _text(content: object, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, Mapping)):
        parts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"message {index}: a content part must be {{'type': 'text', 'text': str}}, "
                                 f"got {part!r}")
            parts.append(part["text"])
        return join_text_parts(parts)
    raise ValueError(f"message {index}: 'content' must be a string or a list of text parts, got {content!r}")
