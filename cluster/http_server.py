"""The HTTP server of the OpenAI-compatible API (``openai_api``), on the gRPC server's event loop.

It runs uvicorn in the loop of ``kvserve serve`` beside the gRPC server, on the
same ``Frontend``, so both front doors share one request pipeline, one limit of
concurrent requests and one fetch of outputs from the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn

from kvserve.cluster.config import ServerConfig
from kvserve.cluster.frontend import END_STREAMS_S, SHUTTING_DOWN, Frontend
from kvserve.cluster.openai_api import create_app
from kvserve.cluster.openai_protocol import choice_limit, request_limit

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 30.0


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: ``kvserve serve`` handles SIGINT and SIGTERM itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """A started HTTP server; ``port`` is the one actually bound."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task[None], port: int, frontend: Frontend) -> None:
        self._server = server
        self._task = task
        self._frontend = frontend
        self.port = port

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting connections, let requests in flight finish for ``grace_s``, then close.

        Requests still running then end with the server's own error ("the server is shutting
        down": a stream's error event and ``[DONE]``, a 503 for a whole completion) and are
        aborted; uvicorn gives their answers a moment more to be sent.  (At its own timeout it
        cancelled them: the client's connection was cut mid-body, and the log had an ERROR and a
        traceback for each.)
        """
        self._server.config.timeout_graceful_shutdown = grace_s + END_STREAMS_S
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace_s)
        except asyncio.TimeoutError:
            self._frontend.end_streams(SHUTTING_DOWN)
        await self._task


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: a free port); ``RuntimeError`` when that address cannot be bound."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            # NOTE: SO_REUSEADDR only (a port whose old connections linger in TIME_WAIT is free), not
            # SO_REUSEPORT, which would let a second server share a taken port.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
        except OSError:
            sock.close()
            raise
    except OSError as exc:  # socket.gaierror included
        shown = f"[{host}]" if ":" in host else host
        raise RuntimeError(f"cannot listen on {shown}:{port} for HTTP: {exc.strerror or exc}") from None
    return sock


async def start_http_server(
    frontend: Frontend, config: ServerConfig, *, chat_template: str | None = None
) -> HttpServer:
    """Serve the OpenAI-compatible API of ``frontend`` at ``config.host:config.http_port``.

    Call from the server's event loop.  Request bodies are limited to
    ``config.max_message_bytes``, as gRPC messages are.  ``chat_template``
    (Jinja text) replaces the tokenizer's own for chat completions.
    """
    if config.http_port is None:
        raise ValueError("http_port is None: the HTTP server is off")
    host = config.host
    sock = bind_socket(host, config.http_port)
    bound_port = sock.getsockname()[1]
    uvicorn_config = uvicorn.Config(
        create_app(
            frontend, chat_template=chat_template, max_body_bytes=config.max_message_bytes,
            max_choices=choice_limit(config.max_concurrent_requests, config.max_concurrent_requests_per_tenant),
            max_requests=request_limit(config.max_concurrent_requests, config.max_concurrent_requests_per_tenant),
        ),
        lifespan="off",
        log_config=None,  # kvserve's logging configuration, not uvicorn's
        access_log=False,
        # NOTE: longer than uvicorn's 5 s, so that clients' connection pools reuse their connections.
        timeout_keep_alive=30,
        **(config.tls.uvicorn_options() if config.tls is not None else {}),
    )
    server = _EmbeddedServer(uvicorn_config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="http-server")
    deadline = asyncio.get_running_loop().time() + _STARTUP_TIMEOUT_S
    while not server.started:
        if task.done():
            sock.close()
            error = task.exception() if not task.cancelled() else None
            raise RuntimeError(f"the HTTP server on {host}:{bound_port} did not start: {error}")
        if asyncio.get_running_loop().time() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the HTTP server on {host}:{bound_port} did not start in {_STARTUP_TIMEOUT_S:g} s")
        await asyncio.sleep(0.01)
    scheme = "https" if config.tls is not None else "http"
    logger.info("serving the OpenAI-compatible API on %s://%s:%d", scheme, host, bound_port)
    return HttpServer(server, task, bound_port, frontend)
