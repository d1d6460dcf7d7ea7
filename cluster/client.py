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
raise ``RequestError`` with its status code and message.

``RequestError("UNAVAILABLE", ...)`` from a stream that had already yielded
deltas means the stream was cut mid-way (its replica failed and no other could
go on with it, or the server lost its scheduler or is stopping): the deltas
received stand, but the completion cannot be resumed.  A retry starts over
from the prompt, and its tokens need not repeat those received: discard what
was shown of the cut stream before retrying, or do not retry.  Before the first
delta, nothing was received: UNAVAILABLE may be retried as usual.

A stream sends its request when its iteration starts; leaving it early
(closing the iterator, or leaving a ``for`` over ``client.stream(...)`` by
``break`` or an exception) cancels the call, and the server aborts the request
and frees its blocks.

``token`` is sent as ``authorization: Bearer <token>`` with every call;
``tls_ca`` (a PEM file of the certificate authority to trust) switches the
channel to TLS.  ``tls_cert`` and ``tls_key`` (PEM files, both or neither) are
the client certificate that a server started with ``--tls-client-ca`` requires;
they too switch the channel to TLS (trusting the system's CAs without ``tls_ca``).
A bad ``target``, token, CA, certificate or key file (unreadable, not PEM, a key
that is not the certificate's) raises ``ValueError`` (or ``TypeError``) when the
client is made; an unreachable server is ``RequestError("UNAVAILABLE", ...)`` at
the first call, and the client reconnects by itself once the server is back (within
about ``MAX_RECONNECT_BACKOFF_S``).
A closed client raises ``RuntimeError``.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import AsyncIterator, Iterator, Sequence
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
from kvserve.cluster.host_port import check_grpc_target
from kvserve.cluster.tls import check_ca_file, check_key_pair
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
# NOTE: while the server is down, grpc waits longer and longer between connection
# attempts (up to 120 s) and fails every call in between at once: after a restart
# of ~40 s, calls still failed with UNAVAILABLE for 11 s.  A failed attempt on a
# refused port costs next to nothing, so the wait is capped.
MAX_RECONNECT_BACKOFF_S = 2.0


class _Settings:
    """What both clients derive from their arguments: call metadata, channel options, credentials."""

    def __init__(
        self,
        target: str,
        token: str | None,
        tls_ca: str | os.PathLike[str] | None,
        max_message_bytes: int,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
    ) -> None:
        self.target = _check_target(target)
        self.metadata = _bearer_metadata(token)
        self.credentials = _tls_credentials(tls_ca, tls_cert, tls_key)
        if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) or max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be a positive integer, got {max_message_bytes!r}")
        self.options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_reconnect_backoff_ms", int(MAX_RECONNECT_BACKOFF_S * 1000)),
        ]

    def channel(self, grpc_module: Any) -> Any:
        """A channel to the target from ``grpc`` or ``grpc.aio`` (the same calls), with TLS if asked."""
        if self.credentials is None:
            return grpc_module.insecure_channel(self.target, self.options)
        return grpc_module.secure_channel(self.target, self.credentials, self.options)


class Client:
    """A blocking client; one channel, safe to share between threads.  Close it, or use it as a context manager."""

    def __init__(
        self,
        target: str,
        token: str | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
    ) -> None:
        settings = _Settings(target, token, tls_ca, max_message_bytes, tls_cert, tls_key)
        self._metadata = settings.metadata
        self._channel = settings.channel(grpc)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)
        self._closed = False

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
        """The completion of ``prompt`` as it is generated, one delta per message.

        The arguments are checked at once; the request is sent when the iteration starts.
        ``RequestError("UNAVAILABLE")`` after some deltas: the stream was cut, and a retry
        starts over (see the module docstring).
        """
        request = to_generate_request(prompt, dict(sampling))
        timeout = _check_timeout(timeout)
        _check_open(self)
        return self._deltas(request, timeout)

    def get_stats(self, *, timeout: float | None = None) -> tuple[ReplicaStats, ...]:
        """Every replica's load and cache figures."""
        timeout = _check_timeout(timeout)
        _check_open(self)
        try:
            response = self._stub.GetStats(generate_pb2.GetStatsRequest(), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _request_error(exc) from None
        return to_replica_stats(response)

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled, and later calls raise ``RuntimeError``."""
        self._closed = True
        self._channel.close()

    def _deltas(self, request: generate_pb2.GenerateRequest, timeout: float | None) -> Iterator[CompletionDelta]:
        # NOTE: the call starts here, at the first next(): a stream closed before that
        # leaves nothing running (a call started in stream() ran on to its end).
        _check_open(self)
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        # NOTE: the prompt's logprobs come with the first message that carries tokens (the first, but for an abort).
        pending = request.sampling_params.HasField("prompt_logprobs")
        try:
            for response in call:
                yield to_delta(response, with_prompt_logprobs=pending and bool(response.token_ids))
                pending = pending and not response.token_ids
        except grpc.RpcError as exc:
            raise _request_error(exc) from None
        finally:
            # A consumer that stops early: the server aborts the request and frees its blocks.
            call.cancel()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClient:
    """An asyncio client, bound to the event loop it is made in (``RuntimeError`` outside one, or
    when used from another loop); concurrent calls share its channel.  Close it, or ``async with`` it."""

    def __init__(
        self,
        target: str,
        token: str | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
    ) -> None:
        settings = _Settings(target, token, tls_ca, max_message_bytes, tls_cert, tls_key)
        try:
            # NOTE: a grpc.aio channel belongs to the loop running when it is made; made
            # outside one, its first call failed deep in grpc ("attached to a different loop").
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                "AsyncClient must be made inside the event loop that uses it (in a coroutine); "
                "outside one, use Client"
            ) from None
        self._metadata = settings.metadata
        self._channel = settings.channel(grpc.aio)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)
        self._closed = False

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
        """The completion of ``prompt`` as it is generated, one delta per message.

        The arguments are checked at once; the request is sent when the iteration starts.
        ``RequestError("UNAVAILABLE")`` after some deltas: the stream was cut, and a retry
        starts over (see the module docstring).
        """
        request = to_generate_request(prompt, dict(sampling))
        timeout = _check_timeout(timeout)
        self._check_usable()
        return self._deltas(request, timeout)

    async def get_stats(self, *, timeout: float | None = None) -> tuple[ReplicaStats, ...]:
        """Every replica's load and cache figures."""
        timeout = _check_timeout(timeout)
        self._check_usable()
        try:
            response = await self._stub.GetStats(
                generate_pb2.GetStatsRequest(), timeout=timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise _request_error(exc) from None
        except asyncio.CancelledError:
            _refuse_if_closed_under_the_call(self)
            raise
        return to_replica_stats(response)

    async def close(self) -> None:
        """Close the channel; calls in flight end with ``RequestError("CANCELLED")`` (on Python 3.10,
        grpc's ``asyncio.CancelledError``), and later calls raise ``RuntimeError``."""
        self._closed = True
        await self._channel.close()

    def _check_usable(self) -> None:
        _check_open(self)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not self._loop:
            raise RuntimeError(
                "this AsyncClient belongs to the event loop it was made in: make one inside each loop that calls it"
            )

    async def _deltas(
        self, request: generate_pb2.GenerateRequest, timeout: float | None
    ) -> AsyncIterator[CompletionDelta]:
        # NOTE: as Client._deltas, the call starts at the first anext().
        self._check_usable()
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        # NOTE: the prompt's logprobs come with the first message that carries tokens (the first, but for an abort).
        pending = request.sampling_params.HasField("prompt_logprobs")
        try:
            async for response in call:
                yield to_delta(response, with_prompt_logprobs=pending and bool(response.token_ids))
                pending = pending and not response.token_ids
        except grpc.RpcError as exc:
            raise _request_error(exc) from None
        except asyncio.CancelledError:
            _refuse_if_closed_under_the_call(self)
            raise
        finally:
            call.cancel()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _refuse_if_closed_under_the_call(client: AsyncClient) -> None:
    """``RequestError("CANCELLED")`` for an ``AsyncClient`` call that its own ``close()`` cut short;
    nothing if the task is being cancelled, or the client is open (the ``CancelledError`` stands).

    NOTE: grpc.aio ends such a call with ``asyncio.CancelledError`` though no task was cancelled: the
    caller's task then ended as cancelled, which ``except Exception`` does not catch.  The blocking
    ``Client`` raises ``RequestError("CANCELLED")`` there; so does this one from Python 3.11 (before
    it, a task cannot tell a cancellation of its own from grpc's, and the ``CancelledError`` stands).
    """
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    if client._closed and cancelling is not None and cancelling() == 0:
        raise RequestError("CANCELLED", "the client was closed while the call was in flight") from None


def _request_error(error: grpc.RpcError) -> RequestError:
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else None
    return RequestError(code.name if code is not None else "UNKNOWN", details or str(error))


def _check_target(target: str) -> str:
    """``target`` if it is ``HOST:PORT`` or a gRPC target with a resolver's scheme (``dns:``, ``unix:``, ...).

    NOTE: grpc took "127.0.0.1" for port 443 and a URL ("http://...") for a host
    name, and both failed only at the first call, as an unreachable server.
    """
    if not isinstance(target, str):
        raise TypeError(f"target must be a str such as '127.0.0.1:50051', got {type(target).__name__}")
    try:
        return check_grpc_target(target)
    except ValueError as exc:
        hint = " (tls_ca=... for TLS)" if "://" in target else ""
        raise ValueError(f"target: {exc}{hint}") from None


def _check_open(client: Client | AsyncClient) -> None:
    if client._closed:
        # NOTE: else grpc's own error, a ValueError or grpc.aio.UsageError that names no client.
        raise RuntimeError(f"this {type(client).__name__} is closed")


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


def _tls_credentials(
    tls_ca: str | os.PathLike[str] | None,
    tls_cert: str | os.PathLike[str] | None,
    tls_key: str | os.PathLike[str] | None,
) -> grpc.ChannelCredentials | None:
    """TLS credentials when any of the three files is given, else ``None`` (plaintext)."""
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert and tls_key go together: give both (a client certificate and its key) or neither")
    if tls_ca is None and tls_cert is None:
        return None
    root_certificates = None if tls_ca is None else check_ca_file(tls_ca, name="tls_ca")
    if tls_cert is None or tls_key is None:
        return grpc.ssl_channel_credentials(root_certificates=root_certificates)
    # NOTE: grpc takes any bytes here too and fails only at the first call, as UNAVAILABLE;
    # Python's ssl checks both files now, naming the one at fault.
    certificate_chain, private_key = check_key_pair(tls_cert, tls_key, cert_name="tls_cert", key_name="tls_key")
    return grpc.ssl_channel_credentials(
        root_certificates=root_certificates, private_key=private_key, certificate_chain=certificate_chain
    )

