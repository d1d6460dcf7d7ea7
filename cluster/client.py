"""The Python client of a kvserve server, over its gRPC API: ``Client`` (blocking) and ``AsyncClient``.

::

    from kvserve.client import Client

    with Client("127.0.0.1:50051") as client:
        completion = client.generate("Once upon a time", max_tokens=32, temperature=0)
        print(completion.text, completion.finish_reason, completion.usage)
        for delta in client.stream("Once upon a time", max_tokens=32):
            print(delta.text, end="", flush=True)

The keyword arguments of ``generate`` and ``stream`` are ``SamplingKwargs``
plus ``timeout`` (the call's deadline in seconds); an unknown one raises
``TypeError`` before anything is sent.  The server's refusals and failures
raise ``RequestError`` with its status code and message.  Leaving a stream
early (``break``, an exception, closing the iterator) cancels the call, and the
server aborts the request and frees its blocks.

``token`` is sent as ``authorization: Bearer <token>`` with every call;
``tls_ca`` (a PEM file of the certificate authority to trust) switches the
channel to TLS.
"""

from __future__ import annotations

import math
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from kvserve.cluster.client_messages import (
    Completion,
    CompletionBuilder,
    CompletionDelta,
    ReplicaStats,
    RequestError,
    SamplingKwargs,
    Usage,
    to_delta,
    to_generate_request,
    to_replica_stats,
)
from kvserve.proto import generate_pb2, generate_pb2_grpc

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "AsyncClient",
    "Client",
    "Completion",
    "CompletionDelta",
    "ReplicaStats",
    "RequestError",
    "SamplingKwargs",
    "Usage",
]

# NOTE: the server's default limit (kvserve.cluster.config.DEFAULT_MAX_MESSAGE_BYTES,
# spelled out so that the client imports neither the scheduler nor numpy; a test keeps
# the two equal).
DEFAULT_MAX_MESSAGE_BYTES = 4 * 2**20


class _Settings:
    """What both clients derive from their arguments: call metadata, channel options, credentials."""

    def __init__(self, token: str | None, tls_ca: str | os.PathLike[str] | None, max_message_bytes: int) -> None:
        self.metadata = _bearer_metadata(token)
        self.credentials = _tls_credentials(tls_ca)
        if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) or max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be a positive integer, got {max_message_bytes!r}")
        self.options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]

    def channel(self, grpc_module: Any, target: str) -> Any:
        """A channel to ``target`` from ``grpc`` or ``grpc.aio`` (the same calls), with TLS if asked."""
        if self.credentials is None:
            return grpc_module.insecure_channel(target, self.options)
        return grpc_module.secure_channel(target, self.credentials, self.options)


class Client:
    """A blocking client; one channel, safe to share between threads.  Close it, or use it as a context manager."""

    def __init__(
        self,
        target: str,
        token: str | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        settings = _Settings(token, tls_ca, max_message_bytes)
        self._metadata = settings.metadata
        self._channel = settings.channel(grpc, target)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)

    def generate(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **sampling: Unpack[SamplingKwargs]
    ) -> Completion:
        """The whole completion of ``prompt`` (text, or token ids)."""
        builder = CompletionBuilder()
        for delta in self.stream(prompt, timeout=timeout, **sampling):
            builder.add(delta)
        return builder.build()

    def stream(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **sampling: Unpack[SamplingKwargs]
    ) -> Iterator[CompletionDelta]:
        """The completion of ``prompt`` as it is generated, one delta per message."""
        request = to_generate_request(prompt, dict(sampling))
        call = self._stub.Generate(request, timeout=_check_timeout(timeout), metadata=self._metadata)
        return _deltas(call)

    def get_stats(self, *, timeout: float | None = None) -> tuple[ReplicaStats, ...]:
        """Every replica's load and cache figures."""
        try:
            response = self._stub.GetStats(
                generate_pb2.GetStatsRequest(), timeout=_check_timeout(timeout), metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise _request_error(exc) from None
        return to_replica_stats(response)

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClient:
    """An asyncio client.  Create it inside the event loop that uses it; close it, or ``async with`` it."""

    def __init__(
        self,
        target: str,
        token: str | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        settings = _Settings(token, tls_ca, max_message_bytes)
        self._metadata = settings.metadata
        self._channel = settings.channel(grpc.aio, target)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)

    async def generate(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **sampling: Unpack[SamplingKwargs]
    ) -> Completion:
        """The whole completion of ``prompt`` (text, or token ids)."""
        builder = CompletionBuilder()
        async for delta in self.stream(prompt, timeout=timeout, **sampling):
            builder.add(delta)
        return builder.build()

    def stream(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **sampling: Unpack[SamplingKwargs]
    ) -> AsyncIterator[CompletionDelta]:
        """The completion of ``prompt`` as it is generated, one delta per message."""
        request = to_generate_request(prompt, dict(sampling))
        call = self._stub.Generate(request, timeout=_check_timeout(timeout), metadata=self._metadata)
        return _async_deltas(call)

    async def get_stats(self, *, timeout: float | None = None) -> tuple[ReplicaStats, ...]:
        """Every replica's load and cache figures."""
        try:
            response = await self._stub.GetStats(
                generate_pb2.GetStatsRequest(), timeout=_check_timeout(timeout), metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise _request_error(exc) from None
        return to_replica_stats(response)

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _deltas(call: grpc.Call) -> Iterator[CompletionDelta]:
    try:
        for response in call:
            yield to_delta(response)
    except grpc.RpcError as exc:
        raise _request_error(exc) from None
    finally:
        # A consumer that stops early: the server aborts the request and frees its blocks.
        call.cancel()


async def _async_deltas(call: grpc.aio.UnaryStreamCall) -> AsyncIterator[CompletionDelta]:
    try:
        async for response in call:
            yield to_delta(response)
    except grpc.RpcError as exc:
        raise _request_error(exc) from None
    finally:
        call.cancel()


def _request_error(error: grpc.RpcError) -> RequestError:
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else None
    return RequestError(code.name if code is not None else "UNKNOWN", details or str(error))


def _check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    is_number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if not (is_number and timeout > 0 and math.isfinite(timeout)):
        # NOTE: grpc answers a deadline of 0 with a bare DEADLINE_EXCEEDED.
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return float(timeout)


def _bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    if token is None:
        return None
    if not isinstance(token, str) or not token or not token.isascii() or not token.isprintable() or " " in token:
        raise ValueError("token must be a non-empty string of printable ASCII characters without spaces")
    return (("authorization", f"Bearer {token}"),)


def _tls_credentials(tls_ca: str | os.PathLike[str] | None) -> grpc.ChannelCredentials | None:
    if tls_ca is None:
        return None
    try:
        root_certificates = Path(tls_ca).read_bytes()
    except OSError as exc:
        raise ValueError(f"tls_ca: cannot read {os.fspath(tls_ca)}: {exc.strerror or exc}") from None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)
