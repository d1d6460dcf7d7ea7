"""The OpenAI-compatible HTTP API: a FastAPI app on top of the gRPC front end's pipeline.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (whole,
or streamed as server-sent events with ``stream: true``;
``stream_options.include_usage`` adds the usage chunk), ``GET /v1/models``,
``GET /health`` (200 while some replica can serve, else 503), ``GET /metrics``
(Prometheus, see ``metrics``).  Every request
goes through ``Frontend.responses``, the same validation and request pipeline
as a gRPC ``Generate`` call; the messages are converted in ``openai_protocol``
and ``openai_chat``.

Errors have OpenAI's JSON shape (``{"error": {"message", "type", "param",
"code"}}``): 400 for invalid input (the message names the field), 404 for an
unknown model or path, 429 when the server is at its limit of concurrent
requests, 503 when no replica can serve.  A client that disconnects aborts its
request, which frees its blocks, as a cancelled gRPC call does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.cluster.frontend import Frontend, FrontendError, InvalidRequestError
from kvserve.cluster.metrics import CONTENT_TYPE_LATEST
from kvserve.cluster.openai_chat import ChatCompletionRequest, ChatCompletionShape, render_prompt
from kvserve.cluster.openai_protocol import (
    CompletionRequest,
    Model,
    ModelList,
    TextCompletionShape,
    error_body,
    finish_reason,
    to_generate_request,
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


def served_model_name(model_dir: str) -> str:
    """The model's id in the API: its directory's name."""
    return Path(model_dir).name or model_dir


def create_app(frontend: Frontend, *, chat_template: str | None = None, max_body_bytes: int) -> FastAPI:
    """The app serving ``frontend``'s cluster; the front end must be started (``Frontend.start``).

    ``chat_template`` (Jinja text) replaces the tokenizer's own for chat completions; a
    request body over ``max_body_bytes`` is refused with 413.
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

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[Model(id=model_name, created=created, max_model_len=frontend.model_info.max_model_len)])

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
        try:
            # NOTE: a thread: rendering and tokenizing a long conversation would stall every stream.
            prompt = await asyncio.to_thread(render_prompt, frontend.tokenizer, chat_template, body.messages)
            generate = to_generate_request(body, prompt, body.output_limit, body.num_logprobs)
        except InvalidRequestError as exc:
            return frontend_error_response(exc)
        return await respond(
            frontend, generate, chat_completions, stream=body.stream, include_usage=body.include_usage, request=request
        )

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if (refusal := unknown_model(body.model)) is not None:
            return refusal
        try:
            generate = to_generate_request(body, body.prompt, body.max_tokens, body.logprobs)
        except InvalidRequestError as exc:
            return frontend_error_response(exc)
        return await respond(
            frontend, generate, text_completions, stream=body.stream, include_usage=body.include_usage, request=request
        )

    return app


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
    """How one endpoint's answers look: the whole completion, a chunk (``None``: send none), the usage chunk,
    and the logprobs (of the requests that ask), encoded by a new ``logprobs_encoder()`` per completion."""

    def logprobs_encoder(self) -> LogprobsEncoder: ...

    def whole(
        self, request_id: str, text: str, last: generate_pb2.GenerateResponse, logprobs: BaseModel | None
    ) -> BaseModel: ...

    def chunk(
        self, request_id: str, created: int, text: str, reason: str | None, first: bool, logprobs: BaseModel | None
    ) -> BaseModel | None: ...

    def usage_chunk(self, request_id: str, created: int, last: generate_pb2.GenerateResponse) -> BaseModel: ...


async def respond(
    frontend: Frontend,
    generate: generate_pb2.GenerateRequest,
    shape: ResponseShape,
    *,
    stream: bool,
    include_usage: bool,
    request: Request,
) -> Response:
    """``generate``'s completion through the front end's pipeline, whole or as server-sent events."""
    responses = frontend.responses(generate, tenant=request.state.tenant)
    if stream:
        return await _stream(responses, shape, include_usage)
    return await _complete(responses, shape, request)


async def _complete(
    responses: AsyncIterator[generate_pb2.GenerateResponse], shape: ResponseShape, request: Request
) -> Response:
    """The whole completion, or an error; the request is aborted if the client leaves first."""
    collecting = asyncio.ensure_future(_collect(responses))
    watching = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((collecting, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():
            collecting.cancel()  # the client left: closing the pipeline aborts the request
    try:
        texts, token_ids, logprobs, last = await collecting
    except asyncio.CancelledError:
        logger.debug("a client left before its completion: aborted its request")
        return Response(status_code=499)
    except FrontendError as exc:
        return frontend_error_response(exc)
    encoded = shape.logprobs_encoder().encode(token_ids, logprobs) if logprobs else None
    whole = shape.whole(last.request_id, "".join(texts), last, encoded)
    return Response(whole.model_dump_json(), media_type="application/json")


async def _collect(
    responses: AsyncIterator[generate_pb2.GenerateResponse],
) -> tuple[list[str], list[int], list[generate_pb2.TokenLogprobs], generate_pb2.GenerateResponse]:
    """The texts of every message, the token ids and logprobs of the messages that carry logprobs, the last one."""
    texts: list[str] = []
    token_ids: list[int] = []
    logprobs: list[generate_pb2.TokenLogprobs] = []
    last = None
    async with aclosing(responses):
        async for response in responses:
            texts.append(response.text)
            if response.logprobs:
                token_ids.extend(response.token_ids)
                logprobs.extend(response.logprobs)
            last = response
    if last is None:  # the pipeline always ends with the last message, or raises
        raise RuntimeError("the request ended without a response")
    return texts, token_ids, logprobs, last


async def _wait_for_disconnect(request: Request) -> None:
    # NOTE: with the body read, the server's next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(
    responses: AsyncIterator[generate_pb2.GenerateResponse], shape: ResponseShape, include_usage: bool
) -> Response:
    """Server-sent events; errors found before the first token are answered with their HTTP status."""
    try:
        first = await anext(responses)
    except FrontendError as exc:
        return frontend_error_response(exc)
    except BaseException:
        await responses.aclose()
        raise
    return StreamingResponse(
        _events(first, responses, shape, include_usage),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _events(
    first: generate_pb2.GenerateResponse,
    responses: AsyncIterator[generate_pb2.GenerateResponse],
    shape: ResponseShape,
    include_usage: bool,
) -> AsyncIterator[str]:
    request_id = first.request_id
    created = int(time.time())
    encoder = shape.logprobs_encoder()
    async with aclosing(responses):
        response = first
        try:
            while True:
                reason = finish_reason(response)
                logprobs = encoder.encode(response.token_ids, response.logprobs) if response.logprobs else None
                chunk = shape.chunk(request_id, created, response.text, reason, response is first, logprobs)
                if chunk is not None:
                    yield f"data: {chunk.model_dump_json()}\n\n"
                if reason is not None:
                    if include_usage:
                        yield f"data: {shape.usage_chunk(request_id, created, response).model_dump_json()}\n\n"
                    break
                response = await anext(responses)
        except StopAsyncIteration:  # the pipeline always ends with a finish reason, or raises
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
    location = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON"
    message = first.get("msg", "invalid")
    return f"{location}: {message}" if location else message


def _validation_param(exc: RequestValidationError) -> str | None:
    errors = exc.errors()
    if not errors:
        return None
    location = [str(part) for part in errors[0].get("loc", ()) if part != "body"]
    return location[0] if location else None
