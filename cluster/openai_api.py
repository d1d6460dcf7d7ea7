"""The OpenAI-compatible HTTP API: a FastAPI app on top of the gRPC front end's pipeline.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (whole,
or streamed as server-sent events with ``stream: true``;
``stream_options.include_usage`` adds the usage chunk), ``GET /v1/models``
and ``GET /v1/models/{model}``, ``GET /health`` (200 while some replica can
serve, else 503; ``HEAD`` too), ``GET /metrics`` (Prometheus, see ``metrics``).  Every request
goes through ``Frontend.responses``, the same validation and request pipeline
as a gRPC ``Generate`` call; the messages are converted in ``openai_protocol``
and ``openai_chat``, and answered whole or streamed by ``openai_respond`` (a
request for ``n`` choices is ``n`` requests of that pipeline; a client that
disconnects aborts them).

Errors have OpenAI's JSON shape (``openai_errors``): 400 for invalid input (the
message names the field as the request spelled it; bodies are decoded in
``openai_body``), 404 for an unknown model or path, 413 for a body over the
limit, 429 with ``Retry-After: 1`` when the server (or the tenant) is at its limit
of concurrent requests, 503 when no replica can serve.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.cluster.frontend import Frontend, FrontendError, InvalidRequestError
from kvserve.cluster.metrics import CLIENT_LEFT, CONTENT_TYPE_LATEST, FrontendMetrics
from kvserve.cluster.openai_body import BodyTextError, TextCheckedRoute, validation_error
from kvserve.cluster.openai_chat import (
    ChatCompletionRequest,
    ChatCompletionShape,
    check_text_bytes,
    render_prompt,
    rest_of_context,
    warn_of_a_broken_template,
)
from kvserve.cluster.openai_echo import echoed_prompt
from kvserve.cluster.openai_errors import FieldNames, error_response, frontend_error_response
from kvserve.cluster.openai_prompt_logprobs import PromptLogprobsEncoder, check_num_prompt_logprobs, tokenized_prompt
from kvserve.cluster.openai_protocol import (
    CompletionRequest,
    Model,
    ModelList,
    check_batch_size,
    to_generate_requests,
)
from kvserve.cluster.openai_respond import MEASURED, ChoicePrompt, respond
from kvserve.cluster.openai_text_completion import TextCompletionShape
from kvserve.cluster.openai_tokens import TokenNames
from kvserve.proto import generate_pb2

logger = logging.getLogger(__name__)

# The paths of the requests that ``kvserve_requests_total`` counts.
_GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def served_model_name(model_dir: str) -> str:
    """The model's id in the API: its directory's name."""
    return Path(model_dir).name or model_dir


def create_app(
    frontend: Frontend,
    *,
    chat_template: str | None = None,
    max_body_bytes: int,
    max_choices: int,
    max_requests: int | None = None,
) -> FastAPI:
    """The app serving ``frontend``'s cluster; the front end must be started (``Frontend.start``).

    ``chat_template`` (Jinja text) replaces the tokenizer's own for chat completions; a
    request body over ``max_body_bytes`` is refused with 413, ``n`` over ``max_choices`` with 400
    (``openai_protocol.choice_limit``), and so is a batch of prompts whose choices are more than
    ``max_requests`` requests (``openai_protocol.request_limit``; ``None``: ``max_choices``).
    """
    max_requests = max_requests if max_requests is not None else max_choices
    model_dir = frontend.model_info.model_dir
    model_name = served_model_name(model_dir)
    created = int(time.time())
    warn_of_a_broken_template(frontend.tokenizer, chat_template)
    token_names = TokenNames(frontend.tokenizer)
    text_completions = TextCompletionShape(model_name, token_names)
    chat_completions = ChatCompletionShape(model_name, token_names)
    app = FastAPI(title="kvserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.router.route_class = TextCheckedRoute
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes)

    @app.middleware("http")
    async def bearer_token(request: Request, call_next):
        """With an auth token file, every path but /health needs ``Authorization: Bearer <token>``.

        ``/health/`` is let through too, to the router's redirect to ``/health``: a probe configured with
        the slash gets the same answer with a token file as without one."""
        request.state.tenant = None
        if frontend.access.tokens is not None and request.url.path not in ("/health", "/health/"):
            try:
                request.state.tenant = frontend.access.authenticate(request.headers.get("authorization"))
            except FrontendError as exc:
                client = f"{request.client.host}:{request.client.port}" if request.client else "an unknown client"
                logger.info("refused %s %s from %s: %s", request.method, request.url.path, client, exc)
                refusal = frontend_error_response(exc)
                refusal.headers["WWW-Authenticate"] = "Bearer"
                return refusal
        return await call_next(request)

    # NOTE: added last, so outermost: it sees the refusals of the middlewares above too (401, 413).
    app.add_middleware(RefusalCounter, metrics=frontend.metrics)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_error(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(BodyTextError)
    async def body_not_text(request: Request, exc: BodyTextError) -> JSONResponse:
        return error_response(400, str(exc.detail), param=exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if frontend.is_serving:
            return Response(status_code=200)
        return error_response(503, "no replica is healthy")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        try:
            frontend.access.check_monitoring(request.state.tenant)
        except FrontendError as exc:
            return frontend_error_response(exc)
        try:
            frontend.metrics.set_replica_stats(await frontend.replica_stats())
            frontend.metrics.set_cluster_stats(await frontend.cluster_stats())
        except FrontendError:
            pass  # the request metrics still tell what happened; /health says the cluster is gone
        per_tenant = frontend.access.may_read_tenants(request.state.tenant)
        return Response(frontend.metrics.exposition(per_tenant=per_tenant), media_type=CONTENT_TYPE_LATEST)

    served_model = Model(id=model_name, created=created, max_model_len=frontend.model_info.max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[served_model])

    @app.get("/v1/models/{name:path}", response_model=None)
    async def model(name: str) -> Model | JSONResponse:
        return unknown_model(name) or served_model

    def unknown_model(name: str | None) -> JSONResponse | None:
        if name is None or name in (model_name, model_dir):  # None: a request that left it out
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
        fields = FieldNames("messages", body.max_tokens_field)
        try:
            output_limit = body.output_limit
            num_prompt_logprobs = check_num_prompt_logprobs(body.prompt_logprobs)
            check_text_bytes(body.messages, frontend.limits.max_prompt_bytes)
            # NOTE: a thread: rendering and tokenizing a long conversation would stall every stream.
            prompt = await asyncio.to_thread(render_prompt, frontend.tokenizer, chat_template, body.messages)
            if output_limit is None:
                output_limit = rest_of_context(len(prompt), frontend.model_info.max_model_len)
                fields = FieldNames("messages", max_tokens_default="the context left after the prompt")
            generates = to_generate_requests(
                body, prompt, output_limit, body.num_logprobs, request_id=request_id, max_choices=max_choices,
                prompt_logprobs=num_prompt_logprobs,
            )
        except FrontendError as exc:  # the request's fault (400), or the chat template's (500)
            return frontend_error_response(exc, fields)
        choice_prompt = ChoicePrompt(prompt_logprobs=prompt_logprobs_encoder(prompt, num_prompt_logprobs))
        return await respond(
            frontend, request_id, generates, chat_completions,
            stream=body.stream, include_usage=body.include_usage, request=request, fields=fields,
            prompts=[choice_prompt] * len(generates),
        )

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if (refusal := unknown_model(body.model)) is not None:
            return refusal
        request_id = uuid.uuid4().hex
        prompts = body.prompts
        generates: list[generate_pb2.GenerateRequest] = []
        choice_prompts: list[ChoicePrompt] = []
        try:
            check_batch_size(len(prompts), body.n, max_requests)
            num_prompt_logprobs = check_num_prompt_logprobs(body.prompt_logprobs)
            echoes_logprobs = body.echo and body.logprobs is not None
            # NOTE: one ask serves both: the echoed logprobs keep the first ``logprobs`` alternatives of it.
            asked = [k for k in (body.logprobs if echoes_logprobs else None, num_prompt_logprobs) if k is not None]
            for index, given in enumerate(prompts):
                prompt, token_ids = await tokenized_prompt(
                    given, frontend.tokenizer, frontend.limits.max_prompt_bytes,
                    tokenize=echoes_logprobs or num_prompt_logprobs is not None,
                )
                choices = to_generate_requests(
                    body, prompt, body.max_tokens, body.logprobs, request_id=request_id, max_choices=max_choices,
                    prompt_logprobs=max(asked) if asked else None,
                )
                echo = echoed_prompt(given, token_ids, body.echo, body.logprobs, frontend.tokenizer)
                encoder = prompt_logprobs_encoder(token_ids, num_prompt_logprobs)
                generates += choices
                choice_prompts += [ChoicePrompt(index, echo, encoder)] * len(choices)
        except InvalidRequestError as exc:
            return frontend_error_response(exc)
        if len(prompts) > 1:  # one id per choice of the completion, as a single prompt's choices have
            for number, generate in enumerate(generates):
                generate.request_id = f"{request_id}-{number}"
        return await respond(
            frontend, request_id, generates, text_completions,
            stream=body.stream, include_usage=body.include_usage, request=request, prompts=choice_prompts,
        )

    def prompt_logprobs_encoder(token_ids: list[int] | None, num_top: int | None) -> PromptLogprobsEncoder | None:
        """How the prompt's logprobs are given, when the request asks (``num_top``); a prompt without known
        ids (one the pipeline refuses) has none."""
        if num_top is None:
            return None
        return PromptLogprobsEncoder(token_ids or (), num_top, token_names.text)

    return app


class RefusalCounter:
    """ASGI middleware: counts in ``kvserve_requests_total`` each answer to a generation request that its
    pipelines did not measure, having refused it before (invalid body, unknown model, over the body limit,
    unauthenticated); a client that left before any answer (mid-body: FastAPI answers 400, "error parsing
    the body", to no one) counts as 499."""

    def __init__(self, app: ASGIApp, metrics: FrontendMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in _GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        status: int | str = 500  # what the server answers for an exception that leaves the app
        answered = left = False

        async def receive_noting_a_disconnect() -> Message:
            nonlocal left
            message = await receive()
            left = left or (message["type"] == "http.disconnect" and not answered)
            return message

        async def send_noting_status(message: Message) -> None:
            nonlocal status, answered
            if message["type"] == "http.response.start":
                status, answered = message["status"], True
            await send(message)

        try:
            await self.app(scope, receive_noting_a_disconnect, send_noting_status)
        finally:
            if not scope.get("state", {}).get(MEASURED, False):
                self.metrics.count_request(CLIENT_LEFT if left else status)


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


