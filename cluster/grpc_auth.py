"""The gRPC server's bearer-token check: every RPC but health carries a valid token."""

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
        if handler is None or handler_call_details.method.startswith(_HEALTH_PREFIX):
            return handler
        try:
            self._tokens.authenticate(authorization_header(handler_call_details.invocation_metadata))
        except AuthenticationError as exc:
            logger.info("refused %s: %s", handler_call_details.method, exc)
            if self._on_refused is not None:
                self._on_refused(handler_call_details.method)
            return _refusing(handler, str(exc))
        return handler


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that ends the call with ``UNAUTHENTICATED: message``."""

    async def refuse(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request_or_iterator: Any, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises: a generator only for its kind

    serializers = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, **serializers)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **serializers)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **serializers)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **serializers)
