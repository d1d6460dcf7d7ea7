"""One OpenAI API answer: the choices' pipelines read into a whole completion, or into
server-sent events.

A request for ``n`` choices is ``n`` requests of the front end's pipeline (a batch
of prompts: ``n`` for each, choice ``k * n + i`` prompt ``k``'s ``i``-th), read
together (``openai_choices``): a streamed answer interleaves their chunks, each
naming its choice's ``index`` and ending with its own finish reason; the usage
chunk comes once every choice has ended.  What each choice carries of its prompt is
its ``ChoicePrompt``.  A client that disconnects aborts its
requests, which frees their blocks, as a cancelled gRPC call does; so does an
error in one of its choices.  How each endpoint's answers look is its
``ResponseShape``.  A completion with ``echo`` puts its prompt in front of each choice
(``openai_echo``); a request with ``prompt_logprobs`` gets its prompt's logprobs with each choice
(``openai_prompt_logprobs``), streamed in each choice's first chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Coroutine, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from kvserve.cluster.frontend import Frontend, FrontendError
from kvserve.cluster.openai_choices import interleave
from kvserve.cluster.openai_echo import EchoedPrompt
from kvserve.cluster.openai_errors import (
    COMPLETION_FIELDS,
    FieldNames,
    frontend_error_body,
    frontend_error_response,
)
from kvserve.cluster.openai_kept_tokens import KeptTokens, kept_tokens
from kvserve.cluster.openai_prompt_logprobs import PromptLogprobs, PromptLogprobsEncoder
from kvserve.cluster.openai_protocol import ChoiceOutput, CompletionUsage, finish_reason, to_usage
from kvserve.proto import generate_pb2

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Set in a request's state once its pipelines measure it (``respond``): the refusals before are counted apart.
MEASURED = "measured"


@dataclass(frozen=True, slots=True)
class ChoicePrompt:
    """What one choice's answer carries of its prompt: which prompt of the request it is (``index``: the usage
    counts each prompt once), the prompt its text begins with (``echo``), and how its prompt's logprobs are
    given (``prompt_logprobs``, when the request asks for them)."""

    index: int = 0
    echo: EchoedPrompt | None = None
    prompt_logprobs: PromptLogprobsEncoder | None = None


class LogprobsEncoder(Protocol):
    """One completion's logprobs in an endpoint's shape, one message after another (``None``: an echoed
    prompt's first token, which only text completions have)."""

    def encode(
        self, token_ids: Sequence[int], logprobs: Sequence[generate_pb2.TokenLogprobs | None]
    ) -> BaseModel: ...


class ResponseShape(Protocol):
    """How one endpoint's answers look: the whole completion of its choices, a choice's chunk (``None``: send
    none; ``prompt_logprobs`` on its first only), the usage chunk, and the logprobs (of the requests that
    ask), encoded by a new ``logprobs_encoder(echo)`` per choice (``echo``: the prompt its text begins with)."""

    def logprobs_encoder(self, echo: EchoedPrompt | None = None) -> LogprobsEncoder: ...

    def whole(self, request_id: str, choices: Sequence[ChoiceOutput], usage: CompletionUsage) -> BaseModel: ...

    def chunk(
        self, request_id: str, created: int, index: int, text: str, reason: str | None, first: bool,
        logprobs: BaseModel | None, prompt_logprobs: PromptLogprobs | None = None,
    ) -> BaseModel | None: ...

    def usage_chunk(self, request_id: str, created: int, usage: CompletionUsage) -> BaseModel: ...


async def respond(
    frontend: Frontend,
    request_id: str,
    generates: Sequence[generate_pb2.GenerateRequest],
    shape: ResponseShape,
    *,
    stream: bool,
    include_usage: bool,
    request: Request,
    prompts: Sequence[ChoicePrompt],
    fields: FieldNames = COMPLETION_FIELDS,
) -> Response:
    """The completion of ``generates`` (one request per choice) through the front end's pipeline, whole or as
    server-sent events; ``request_id`` names the completion.  Measured as one request, whatever its number
    of choices.  Errors name the fields as the request did (``fields``); ``prompts``: what each choice
    carries of its prompt."""
    setattr(request.state, MEASURED, True)
    pipelines = [frontend.responses(generate, tenant=request.state.tenant, measured=False) for generate in generates]
    choices = frontend.metrics.track_choices(interleave(pipelines), len(generates))
    kept = [kept_tokens(generate, frontend.tokenizer) for generate in generates]
    if stream:
        return await _stream(request_id, choices, kept, shape, include_usage, fields, prompts, request)
    return await _complete(request_id, choices, kept, shape, request, fields, prompts)


def _tokens_to_send(
    response: generate_pb2.GenerateResponse, kept: KeptTokens | None
) -> tuple[Sequence[int], Sequence[generate_pb2.TokenLogprobs]]:
    """The token ids and logprobs of ``response`` to send: those that its text keeps (``openai_kept_tokens``);
    none when its choice asks for no logprobs."""
    if kept is None:
        return response.token_ids, response.logprobs
    return kept.add(response)


async def _complete(
    request_id: str,
    choices: AsyncIterator[tuple[int, generate_pb2.GenerateResponse]],
    kept: Sequence[KeptTokens | None],
    shape: ResponseShape,
    request: Request,
    fields: FieldNames,
    prompts: Sequence[ChoicePrompt],
) -> Response:
    """The whole completion, or an error; the requests are aborted if the client leaves first."""
    watching = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        collecting = await _unless_the_client_leaves(_collect(choices, kept), watching)
    finally:
        watching.cancel()
    if collecting is None:
        logger.debug("a client left before its completion: aborting its requests")
        return Response(status_code=499)
    try:
        collected = collecting.result()
    except FrontendError as exc:
        return frontend_error_response(exc, fields)
    outputs = []
    for choice, kept_of_choice, prompt in zip(collected, kept, prompts, strict=True):
        text, token_ids, logprobs = "".join(choice.texts), choice.token_ids, choice.logprobs
        if prompt.echo is not None:
            text, token_ids, logprobs = prompt.echo.prepend(text, token_ids, logprobs, choice.prompt_logprobs)
        # A choice that asks for logprobs gets them, empty when a stop string cut all its text.
        asks = logprobs or kept_of_choice is not None
        encoded = shape.logprobs_encoder(prompt.echo).encode(token_ids, logprobs) if asks else None
        encoded_prompt = None
        if prompt.prompt_logprobs is not None:
            encoded_prompt = prompt.prompt_logprobs.encode(choice.prompt_logprobs)
        outputs.append(ChoiceOutput(text, finish_reason(choice.last), encoded, encoded_prompt))
    usage = to_usage([choice.last for choice in collected], [prompt.index for prompt in prompts])
    whole = shape.whole(request_id, outputs, usage)
    return Response(whole.model_dump_json(), media_type="application/json")


@dataclass(slots=True)
class _Collected:
    """One choice's messages: the texts of all, the token ids and logprobs of those that carry logprobs, and
    the prompt's logprobs (of its first message, when its request asked)."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[generate_pb2.TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[generate_pb2.TokenLogprobs] = field(default_factory=list)
    last: generate_pb2.GenerateResponse | None = None


async def _collect(
    choices: AsyncIterator[tuple[int, generate_pb2.GenerateResponse]], kept: Sequence[KeptTokens | None]
) -> list[_Collected]:
    """Every choice's messages, in index order."""
    collected = [_Collected() for _ in kept]
    async with aclosing(choices):
        async for index, response in choices:
            choice = collected[index]
            choice.texts.append(response.text)
            token_ids, logprobs = _tokens_to_send(response, kept[index])
            if logprobs:
                choice.token_ids.extend(token_ids)
                choice.logprobs.extend(logprobs)
            choice.prompt_logprobs.extend(response.prompt_logprobs)
            choice.last = response
    if any(choice.last is None for choice in collected):  # a pipeline always ends with its last message, or raises
        raise RuntimeError("a request ended without a response")
    return collected


async def _wait_for_disconnect(request: Request) -> None:
    # NOTE: with the body read, the server's next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(
    request_id: str,
    choices: AsyncIterator[tuple[int, generate_pb2.GenerateResponse]],
    kept: Sequence[KeptTokens | None],
    shape: ResponseShape,
    include_usage: bool,
    fields: FieldNames,
    prompts: Sequence[ChoicePrompt],
    request: Request,
) -> Response:
    """Server-sent events; errors found before the first token are answered with their HTTP status.
    The requests are aborted as soon as the client leaves, before the first message and between events too.

    NOTE: the choices are admitted or refused (429) as they start, before any of them can have a token
    (but for a text prompt long enough to be tokenized in a thread), so a refused choice gets its status too.
    """
    watching = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        first_message = await _unless_the_client_leaves(anext(choices), watching)
        if first_message is None:
            logger.debug("a client left before its stream's first message: aborting its requests")
            return Response(status_code=499)
        first = first_message.result()
    except FrontendError as exc:
        watching.cancel()
        return frontend_error_response(exc, fields)
    except BaseException:
        # The choices ended with the exception, or the task reading them was cancelled with this one,
        # which closes them: nothing is left open.
        watching.cancel()
        raise
    events = _events(request_id, first, choices, kept, shape, include_usage, fields, prompts)
    return StreamingResponse(
        _until_the_client_leaves(events, watching),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _until_the_client_leaves(events: AsyncIterator[str], watching: asyncio.Future[None]) -> AsyncIterator[str]:
    """``events`` until they end or the client leaves (``watching`` ends: ``_wait_for_disconnect``),
    whichever comes first: then ``events`` is closed, which aborts its requests.

    NOTE: the server notices a client that left only when it next sends to it, or reads from it.  Between
    events (a request queued behind others, a long prefill) a stream the client left kept its place and
    was computed until its first token.
    """
    try:
        while True:
            next_event = await _unless_the_client_leaves(anext(events), watching)
            if next_event is None:
                logger.debug("a client left its stream: aborting its requests")
                return
            try:
                event = next_event.result()
            except StopAsyncIteration:
                return
            try:
                yield event
            except BaseException:
                # NOTE: closed while its event was sent (the client left): the events close in a task of
                # their own, as this one may be in a cancelled scope (Starlette's middleware cancels it when
                # the client leaves), where every await of their closing would be cancelled anew.
                _in_a_task_of_its_own(events.aclose())
                raise
    finally:
        watching.cancel()


async def _unless_the_client_leaves(work: Awaitable[T], watching: asyncio.Future[None]) -> asyncio.Future[T] | None:
    """``work`` run in a task of its own: the task once done, or ``None`` if the client left first
    (``watching`` ended); then, or if this is cancelled, the task is cancelled, which closes what it
    was reading, and so aborts the requests."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait((task, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
    return task if task.done() else None


# Tasks closing streams, referenced until they end (the event loop holds its tasks weakly).
_CLOSING: set[asyncio.Task[None]] = set()


def _in_a_task_of_its_own(closing: Coroutine[Any, Any, None]) -> None:
    task = asyncio.ensure_future(closing)
    _CLOSING.add(task)
    task.add_done_callback(_CLOSING.discard)


async def _events(
    request_id: str,
    first: tuple[int, generate_pb2.GenerateResponse],
    choices: AsyncIterator[tuple[int, generate_pb2.GenerateResponse]],
    kept: Sequence[KeptTokens | None],
    shape: ResponseShape,
    include_usage: bool,
    fields: FieldNames,
    prompts: Sequence[ChoicePrompt],
) -> AsyncIterator[str]:
    created = int(time.time())
    num_choices = len(kept)
    encoders = [shape.logprobs_encoder(prompt.echo) for prompt in prompts]
    started = [False] * num_choices
    lasts: dict[int, generate_pb2.GenerateResponse] = {}  # each ended choice's last message
    async with aclosing(choices):
        index, response = first
        try:
            while True:
                reason = finish_reason(response)
                text, (token_ids, token_logprobs) = response.text, _tokens_to_send(response, kept[index])
                echo, prompt_logprobs = prompts[index].echo, prompts[index].prompt_logprobs
                if echo is not None and not started[index]:  # the prompt comes in each choice's first chunk
                    text, token_ids, token_logprobs = echo.prepend(
                        text, token_ids, token_logprobs, response.prompt_logprobs
                    )
                logprobs = encoders[index].encode(token_ids, token_logprobs) if token_logprobs else None
                prompt = None
                if prompt_logprobs is not None and not started[index]:  # each choice's first chunk
                    prompt = prompt_logprobs.encode(response.prompt_logprobs)
                chunk = shape.chunk(request_id, created, index, text, reason, not started[index], logprobs, prompt)
                started[index] = True
                if chunk is not None:
                    yield f"data: {chunk.model_dump_json()}\n\n"
                if reason is not None:
                    lasts[index] = response
                    if len(lasts) == num_choices:
                        if include_usage:
                            usage = to_usage([lasts[i] for i in range(num_choices)], [p.index for p in prompts])
                            yield f"data: {shape.usage_chunk(request_id, created, usage).model_dump_json()}\n\n"
                        break
                index, response = await anext(choices)
        except StopAsyncIteration:  # the pipelines always end with a finish reason, or raise
            pass
        except FrontendError as exc:  # the same error object as an error status would carry
            yield f"data: {json.dumps(frontend_error_body(exc, fields))}\n\n"
    yield "data: [DONE]\n\n"
