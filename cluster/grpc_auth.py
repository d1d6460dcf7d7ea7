"""Bearer-token checks of gRPC servers: every RPC but health carries a valid token.

Two servers check tokens: the front end (``grpc.aio``, ``BearerTokenInterceptor``) and each
rank's StepWorker server (grpc's threaded server, ``ThreadedBearerTokenInterceptor``, with
its replica's secret).  A call refused is answered ``UNAUTHENTICATED`` before its request is
read: whatever the method's kind, the refusal takes the request stream and never reads it,
so a refused call's body is neither waited for nor parsed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from kvserve.cluster.auth import AuthenticationError, TokenTable

logger = logging.getLogger(__name__)

_HEALTH_PREFIX = "/grpc.health.v1.Health/"


def authorization_header(metadata: Any) -> str | None:
    """The ``authorization`` value of a call's invocation metadata, if any."""
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Invocation metadata that carries ``token``: ``authorization: Bearer <token>``."""
    return (("authorization", f"Bearer {token}"),)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Answers ``UNAUTHENTICATED`` to any call but health's without a valid bearer token."""

    def __init__(self, tokens: TokenTable, on_refused: Callable[[str], None] | None = None) -> None:
        self._tokens = tokens
        self._on_refused = on_refused  # called with the method of each call refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        refusal = _refusal(self._tokens, handler, handler_call_details)
        if refusal is None:
            return handler
        method = handler_call_details.method
        if self._on_refused is not None:
            self._on_refused(method)

        async def refuse(request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
            logger.info("refused %s from %s: %s", method, context.peer(), refusal)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)

        return _refusing(handler, refuse)


class ThreadedBearerTokenInterceptor(grpc.ServerInterceptor):
    """``BearerTokenInterceptor`` for grpc's threaded server: the same check and refusal.

    A refusal is logged as a warning, with the caller's address: on a server whose only
    legitimate caller holds the secret (a StepWorker's), it means someone else called.
    """

    def __init__(self, tokens: TokenTable) -> None:
        self._tokens = tokens

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = continuation(handler_call_details)
        refusal = _refusal(self._tokens, handler, handler_call_details)
        if refusal is None:
            return handler
        method = handler_call_details.method

        def refuse(request_iterator: Any, context: grpc.ServicerContext) -> None:
            logger.warning("refused %s from %s: %s", method, context.peer(), refusal)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)

        return _refusing(handler, refuse)


def _refusal(
    tokens: TokenTable, handler: grpc.RpcMethodHandler | None, handler_call_details: grpc.HandlerCallDetails
) -> str | None:
    """Why the call must be refused; ``None`` for a valid token, health, or an unknown method."""
    if handler is None or handler_call_details.method.startswith(_HEALTH_PREFIX):
        return None
    try:
        tokens.authenticate(authorization_header(handler_call_details.invocation_metadata))
    except AuthenticationError as exc:
        return str(exc)
    return None


def _refusing(handler: grpc.RpcMethodHandler, refuse: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """A handler that ends the call with ``refuse`` before reading its request.

    NOTE: a stream-request handler whatever ``handler``'s kind (the wire format is the same):
    grpc waits for a unary request, and parses it, before it calls the handler; ``refuse``
    gets the request stream unread, and no deserializer would parse it if it were read.
    """
    return grpc.stream_unary_rpc_method_handler(
        refuse, request_deserializer=None, response_serializer=handler.response_serializer
    )
