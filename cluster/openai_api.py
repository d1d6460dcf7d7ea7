"""The OpenAI-compatible HTTP API: a FastAPI app on top of the gRPC front end's pipeline.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (whole,
or streamed as server-sent events with ``stream: true``;
``stream_options.include_usage`` adds the usage chunk), ``GET /v1/models``
and ``GET /v1/models/{model}``, ``GET /health`` (200 while some replica can
serve, else 503), ``GET /metrics`` (Prometheus, see ``metrics``).  Every request
goes through ``Frontend.responses``, the same validation and request pipeline
as a gRPC ``Generate`` call; the messages are converted in ``openai_protocol``
and ``openai_chat``.  A request for ``n`` choices is ``n`` requests of that
pipeline, read together (``openai_choices``): a streamed answer interleaves
their chunks, each naming its choice's ``index`` and ending with its own
finish reason; the usage chunk comes once every choice has ended.

Errors have OpenAI's JSON shape (``{"error": {"message", "type", "param",
"code"}}``): 400 for invalid input (the message names the field), 404 for an
unknown model or path, 429 when the server is at its limit of concurrent
requests, 503 when no replica can serve.  A client that disconnects aborts its
requests, which frees their blocks, as a cancelled gRPC call does; so does an
error in one of its choices.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.cluster.frontend import Frontend, FrontendError, InvalidRequestError
from kvserve.cluster.metrics import CONTENT_TYPE_LATEST, FrontendMetrics
from kvserve.cluster.openai_chat import ChatCompletionRequest, ChatCompletionShape, render_prompt
from kvserve.cluster.openai_choices import interleave
from kvserve.cluster.openai_protocol import (
    ChoiceOutput,
    CompletionRequest,
    CompletionUsage,
    Model,
    ModelList,
    TextCompletionShape,
    error_body,
    finish_reason,
    to_generate_requests,
    to_usage,
    token_text_of,
)
from kvserve.proto import generate_pb2

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


# The gRPC API's two spellings of a prompt: OpenAI's is one field.
_PROMPT_FIELDS = ("text", "token_ids")
# The paths of the requests that ``kvserve_requests_total`` counts.
_GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# Set in a request's state once its pipelines measure it (``respond``): the refusals before are counted apart.
_MEASURED = "measured"


def served_model_name(model_dir: str) -> str:
    """The model's id in the API: its directory's name."""
    return Path(model_dir).name or model_dir


def create_app(
    frontend: Frontend, *, chat_template: str | None = None, max_body_bytes: int, max_choices: int
) -> FastAPI:
    """The app serving ``frontend``'s cluster; the front end must be started (``Frontend.start``).

    ``chat_template`` (Jinja text) replaces the tokenizer's own for chat completions; a
    request body over ``max_body_bytes`` is refused with 413, ``n`` over ``max_choices`` with 400
    (``openai_protocol.choice_limit``).
    """
    model_dir = frontend.model_info.model_dir
    model_name = served_model_name(model_dir)
    created = int(time.time())
    token_text = token_text_of(frontend.tokenizer)
    text_completions = TextCompletionShape(model_name, token_text)
    chat_completions = ChatCompletionShape(model_name, token_text)
    app = FastAPI(title="kvserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes)

    @app.middleware("http")
    async def bearer_token(request: Request, call_next):
        """With an auth token file, every path but /health needs ``Authorization: Bearer <token>``."""
        request.state.tenant = None
        if frontend.tokens is not None and request.url.path != "/health":
            try:
                request.state.tenant = frontend.authenticate(request.headers.get("authorization"))
            except FrontendError as exc:
                refusal = frontend_error_response(exc)
                refusal.headers["WWW-Authenticate"] = "Bearer"
                return refusal
        return await call_next(request)

    # NOTE: added last, so outermost: it sees the refusals of the middlewares above too (401, 413).
    app.add_middleware(RefusalCounter, metrics=frontend.metrics)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, _validation_message(exc), param=_validation_param(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health() -> Response:
        if frontend.is_serving:
            return Response(status_code=200)
        return error_response(503, "no replica is healthy")

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            frontend.metrics.set_replica_stats(await frontend.replica_stats())
            frontend.metrics.set_routing_decisions(*await frontend.routing_decisions())
        except FrontendError:
            pass  # the request metrics still tell what happened; /health says the cluster is gone
        return Response(frontend.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    served_model = Model(id=model_name, created=created, max_model_len=frontend.model_info.max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[served_model])

    @app.get("/v1/models/{name:path}", response_model=None)
    async def model(name: str) -> Model | JSONResponse:
        return unknown_model(name) or served_model

    def unknown_model(name: str) -> JSONResponse | None:
        if name in (model_name, model_dir):
            return None
        return error_response(
            404, f"model {name!r} does not exist; this server serves {model_name!r}",
            code="model_not_found", param="model",
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        if (refusal := unknown_model(body.model)) is not None:
            return refusal
        request_id = uuid.uuid4().hex
        try:
            # NOTE: a thread: rendering and tokenizing a long conversation would stall every stream.
            prompt = await asyncio.to_thread(render_prompt, frontend.tokenizer, chat_template, body.messages)
            generates = to_generate_requests(
                body, prompt, body.output_limit, body.num_logprobs, request_id=request_id, max_choices=max_choices
            )
        except InvalidRequestError as exc:
            return frontend_error_response(exc)
        return await respond(
            frontend, request_id, generates, chat_completions,
            stream=body.stream, include_usage=body.include_usage, request=request,
        )

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if (refusal := unknown_model(body.model)) is not None:
            return refusal
        request_id = uuid.uuid4().hex
        try:
            generates = to_generate_requests(
                body, body.prompt, body.max_tokens, body.logprobs, request_id=request_id, max_choices=max_choices
            )
        except InvalidRequestError as exc:
            return frontend_error_response(exc)
        return await respond(
            frontend, request_id, generates, text_completions,
            stream=body.stream, include_usage=body.include_usage, request=request,
        )

    return app


class RefusalCounter:
    """ASGI middleware: counts in ``kvserve_requests_total`` each answer to a generation request that its
    pipelines did not measure, having refused it before (invalid body, unknown model, over the body limit,
    unauthenticated)."""

    def __init__(self, app: ASGIApp, metrics: FrontendMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in _GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        status = 500  # what the server answers for an exception that leaves the app

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            if not scope.get("state", {}).get(_MEASURED, False):
                self.metrics.count_request(status)


class BodyLimit:
    """ASGI middleware: 413 for a request body over ``max_body_bytes``, declared or streamed."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = f"the request body is larger than the server's limit of {self.max_body_bytes} bytes"
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await error_response(413, too_large)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # NOTE: FastAPI passes an HTTPException from reading the body on to its handler.
                    raise StarletteHTTPException(413, too_large)
            return message

        await self.app(scope, limited_receive, send)


def error_response(status: int, message: str, *, code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(message, type_=_ERROR_TYPES.get(status, "invalid_request_error"), code=code, param=param),
        status_code=status,
    )


def frontend_error_response(error: FrontendError) -> JSONResponse:
    """``error`` in OpenAI's terms: the pipeline's messages name the gRPC API's fields."""
    message = str(error).replace("sampling_params.", "")
    param = None
    if isinstance(error, InvalidRequestError):
        field = re.match(r"[a-z_]+\b", message)
        param = field[0] if field else None
        if param in _PROMPT_FIELDS:
            message = "prompt" + message[len(param):]
            param = "prompt"
    return error_response(error.http_status, message, param=param)


class LogprobsEncoder(Protocol):
    """One completion's logprobs in an endpoint's shape, one message after another."""

    def encode(self, token_ids: Sequence[int], logprobs: Sequence[generate_pb2.TokenLogprobs]) -> BaseModel: ...


class ResponseShape(Protocol):
    """How one endpoint's answers look: the whole completion of its choices, a choice's chunk (``None``: send
    none), the usage chunk, and the logprobs (of the requests that ask), encoded by a new
    ``logprobs_encoder()`` per choice."""

    def logprobs_encoder(self) -> LogprobsEncoder: ...

    def whole(self, request_id: str, choices: Sequence[ChoiceOutput], usage: CompletionUsage) -> BaseModel: ...

    def chunk(
        self, request_id: str, created: int, index: int, text: str, reason: str | None, first: bool,
        logprobs: BaseModel | None,
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
) -> Response:
    """The completion of ``generates`` (one request per choice) through the front end's pipeline, whole or as
    server-sent events; ``request_id`` names the completion.  Measured as one request, whatever its ``n``."""
    setattr(request.state, _MEASURED, True)
    pipelines = [frontend.responses(generate, tenant=request.state.tenant, measured=False) for generate in generates]
    choices = frontend.metrics.track_choices(interleave(pipelines), len(generates))
    if stream:
        return await _stream(request_id, choices, len(generates), shape, include_usage)
    return await _complete(request_id, choices, len(generates), shape, request)


async def _complete(
    request_id: str,
    choices: AsyncIterator[tuple[int, generate_pb2.GenerateResponse]],
    num_choices: int,
    shape: ResponseShape,
    request: Request,
) -> Response:
    """The whole completion, or an error; the requests are aborted if the client leaves first."""
    collecting = asyncio.ensure_future(_collect(choices, num_choices))
    watching = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((collecting, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():
            collecting.cancel()  # the client left: closing the pipelines aborts the requests
    try:
        collected = await collecting
    except asyncio.CancelledError:
        logger.debug("a client left before its completion: aborted its requests")
        return Response(status_code=499)
    except FrontendError as exc:
        return frontend_error_response(exc)
    outputs = [
        ChoiceOutput(
            "".join(choice.texts),
            finish_reason(choice.last),
            shape.logprobs_encoder().encode(choice.token_ids, choice.logprobs) if choice.logprobs else None,
        )
        for choice in collected
    ]
    whole = shape.whole(request_id, outputs, to_usage([choice.last for choice in collected]))
    return Response(whole.model_dump_json(), media_type="application/json")


@dataclass(slots=True)
class _Collected:
    """One choice's messages: the texts of all, the token ids and logprobs of those that carry logprobs."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[generate_pb2.TokenLogprobs] = field(default_factory=list)
    last: generate_pb2.GenerateResponse | None = None


async def _collect(
    choices: AsyncIterator[tuple[int, generate_pb2.GenerateResponse]], num_choices: int
) -> list[_Collected]:
    """Every choice's messages, in index order."""
    collected = [_Collected() for _ in range(num_choices)]
    async with aclosing(choices):
        async for index, response in choices:
            choice = collected[index]
            choice.texts.append(response.text)
            if response.logprobs:
                choice.token_ids.extend(response.token_ids)
                choice.logprobs.extend(response.logprobs)
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
    num_choices: int,
    shape: ResponseShape,
    include_usage: bool,
) -> Response:
    """Server-sent events; errors found before the first token are answered with their HTTP status.

    NOTE: the choices are admitted or refused (429) as they start, before any of them can have a token
    (but for a text prompt long enough to be tokenized in a thread), so a refused choice gets its status too.
    """
    try:
        first = await anext(choices)
    except FrontendError as exc:
        return frontend_error_response(exc)
    except BaseException:
        await choices.aclose()
        raise
    return StreamingResponse(
        _events(request_id, first, choices, num_choices, shape, include_usage),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _events(
    request_id: str,
    first: tuple[int, generate_pb2.GenerateResponse],
    choices: AsyncIterator[tuple[int, generate_pb2.GenerateResponse]],
    num_choices: int,
    shape: ResponseShape,
    include_usage: bool,
) -> AsyncIterator[str]:
    created = int(time.time())
    encoders = [shape.logprobs_encoder() for _ in range(num_choices)]
    started = [False] * num_choices
    lasts: dict[int, generate_pb2.GenerateResponse] = {}  # each ended choice's last message
    async with aclosing(choices):
        index, response = first
        try:
            while True:
                reason = finish_reason(response)
                logprobs = encoders[index].encode(response.token_ids, response.logprobs) if response.logprobs else None
                chunk = shape.chunk(request_id, created, index, response.text, reason, not started[index], logprobs)
                started[index] = True
                if chunk is not None:
                    yield f"data: {chunk.model_dump_json()}\n\n"
                if reason is not None:
                    lasts[index] = response
                    if len(lasts) == num_choices:
                        if include_usage:
                            usage = to_usage([lasts[i] for i in range(num_choices)])
                            yield f"data: {shape.usage_chunk(request_id, created, usage).model_dump_json()}\n\n"
                        break
                index, response = await anext(choices)
        except StopAsyncIteration:  # the pipelines always end with a finish reason, or raise
            pass
        except FrontendError as exc:
            status = exc.http_status
            body = error_body(str(exc), type_=_ERROR_TYPES.get(status, "internal_error"), code=str(status))
            yield f"data: {json.dumps(body)}\n\n"
    yield "data: [DONE]\n\n"


def _validation_message(exc: RequestValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "the request body is invalid"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON"
    location = _field_location(first)
    if not location:  # the body itself: absent, not JSON (another content type), or not an object
        return "the request body must be a JSON object, sent with Content-Type: application/json"
    return f"{'.'.join(location)}: {first.get('msg', 'invalid')}"


def _validation_param(exc: RequestValidationError) -> str | None:
    errors = exc.errors()
    if not errors or errors[0].get("type") == "json_invalid":  # its location is a character offset
        return None
    location = _field_location(errors[0])
    return location[0] if location else None


def _field_location(error: dict) -> list[str]:
    """Where in the body a validation error is: its field, then the parts within it ([]: the whole body)."""
    return [str(part) for part in error.get("loc", ()) if part != "body"]
