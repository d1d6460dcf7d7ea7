"""The public gRPC server: Generation, grpc.health.v1 and server reflection.

``grpc.health.v1`` reports SERVING (for the whole server and for
``kvserve.v1.Generation``) once the server is started on a ready cluster, and
NOT_SERVING while it stops, while no replica is healthy, or for good once the
scheduler actor is lost.  Reflection
lets ``grpcurl`` list and call the services without the ``.proto`` files.
Message sizes are explicit limits in both directions.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvserve.cluster.auth import TokenTable
from kvserve.cluster.config import ServerConfig
from kvserve.cluster.frontend import END_STREAMS_S, SHUTTING_DOWN, Frontend
from kvserve.cluster.frontend_errors import UnauthenticatedError
from kvserve.cluster.grpc_auth import BearerTokenInterceptor
from kvserve.cluster.messages import ModelInfo
from kvserve.cluster.tolerant_handlers import add_tolerant_service
from kvserve.proto import generate_pb2
from kvserve.worker.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

_GENERATION = generate_pb2.DESCRIPTOR.services_by_name["Generation"]
GENERATION_SERVICE = _GENERATION.full_name
_GENERATE_METHOD = f"/{GENERATION_SERVICE}/{_GENERATION.methods_by_name['Generate'].name}"
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
_OVERALL = ""  # grpc.health.v1's name for the whole server


def check_address_free(config: ServerConfig) -> None:
    """``RuntimeError`` unless ``config``'s address can be bound now.

    For a check before a slow start-up (Ray, the replicas); the server's own
    bind is what counts, as the port may be taken in between.
    """
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            config.host, config.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as sock:
            # As grpc binds: a port whose old connections linger in TIME_WAIT is free.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
    except OSError as exc:  # socket.gaierror included
        raise RuntimeError(f"cannot listen on {config.address}: {exc.strerror or exc}") from None


def add_port(server: grpc.aio.Server, config: ServerConfig, credentials: grpc.ServerCredentials | None) -> int:
    """Bind ``config``'s address, with TLS when ``credentials``; the port bound.

    ``RuntimeError`` when grpc cannot.  NOTE: grpc reports TLS credentials it cannot use
    as a failure to bind ("Failed to bind"), so with TLS on the message names them too.
    """
    try:
        if credentials is None:
            port = server.add_insecure_port(config.address)
        else:
            port = server.add_secure_port(config.address, credentials)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot listen on {config.address}: {exc}{_tls_hint(config)}") from None
    if port == 0:
        raise RuntimeError(f"cannot listen on {config.address}{_tls_hint(config)}")
    return port


def _tls_hint(config: ServerConfig) -> str:
    if config.tls is None:
        return ""
    return (
        f" (or grpc could not use the TLS credentials: certificate {config.tls.cert}, key {config.tls.key}"
        + (f", client CA {config.tls.client_ca}" if config.tls.client_ca is not None else "")
        + "; grpc reports both as a failure to bind)"
    )


class GenerationServer:
    """A started gRPC server; ``port`` is the one actually bound."""

    def __init__(
        self,
        server: grpc.aio.Server,
        port: int,
        frontend: Frontend,
        health_servicer: health.aio.HealthServicer,
        scheduler_lost: asyncio.Event,
    ) -> None:
        self.server = server
        self.port = port
        self.frontend = frontend
        self.health_servicer = health_servicer
        # Set once the scheduler actor is gone: nothing can be served any more.
        self.scheduler_lost = scheduler_lost

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Report NOT_SERVING, let streams in flight finish for ``grace_s``, then close.

        Streams still running then end with ``UNAVAILABLE: the server is
        shutting down`` (grpc's own cancellation said only "Cancelling all
        calls") and their requests are aborted.
        """
        await self.health_servicer.enter_graceful_shutdown()
        if grace_s is None:
            await self.server.stop(None)
        else:
            # A moment more than the grace, for the streams ended below to send their status.
            stopping = asyncio.ensure_future(self.server.stop(grace_s + END_STREAMS_S))
            try:
                await asyncio.wait_for(asyncio.shield(stopping), grace_s)
            except asyncio.TimeoutError:
                self.frontend.end_streams(SHUTTING_DOWN)
            await stopping
        await self.frontend.stop()


async def start_server(scheduler: Any, model_info: ModelInfo, config: ServerConfig) -> GenerationServer:
    """Serve the cluster behind ``scheduler`` (the scheduler actor's handle) at ``config``'s address.

    Call from the event loop that will run the server.  ``RuntimeError`` when
    the address cannot be bound; ``ValueError`` for an unreadable token file or TLS file.
    With ``config.auth_token_file`` every RPC but health needs a bearer token
    (``UNAUTHENTICATED`` otherwise); with ``config.tls`` the port speaks TLS.
    """
    tokens = TokenTable.from_file(config.auth_token_file) if config.auth_token_file is not None else None
    if tokens is not None:
        tokens.check_tenant_names(config.monitoring_tenants, flag="monitoring_tenants")
    credentials = config.tls.server_credentials() if config.tls is not None else None
    health_servicer = health.aio.HealthServicer()

    async def set_serving(serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in (_OVERALL, GENERATION_SERVICE):
            await health_servicer.set(service, status)

    scheduler_lost = asyncio.Event()

    async def on_scheduler_lost() -> None:
        await set_serving(False)  # for good: the front end fetches nothing more
        scheduler_lost.set()

    frontend = Frontend(
        scheduler,
        model_info,
        load_tokenizer(model_info.model_dir),
        max_concurrent_requests=config.max_concurrent_requests,
        max_concurrent_requests_per_tenant=config.max_concurrent_requests_per_tenant,
        stream_interval_s=config.stream_interval_s,
        max_messages_per_s=config.max_messages_per_s,
        on_scheduler_lost=on_scheduler_lost,
        on_serving_changed=set_serving,
        tokens=tokens,
        monitoring_tenants=frozenset(config.monitoring_tenants),
        limits=config.limits,
    )

    def count_refused(method: str) -> None:
        if method == _GENERATE_METHOD:  # kvserve_requests_total counts generations, as over HTTP
            frontend.metrics.count_request(UnauthenticatedError.http_status)

    server = grpc.aio.server(
        interceptors=[BearerTokenInterceptor(tokens, on_refused=count_refused)] if tokens is not None else None,
        options=[
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_receive_message_length", config.max_message_bytes),
            # NOTE: grpc sets SO_REUSEPORT by default, so a second server on a
            # taken port started silently and the kernel split clients between two clusters.
            ("grpc.so_reuseport", 0),
        ]
    )
    add_tolerant_service(server, frontend, _GENERATION)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((GENERATION_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
    port = add_port(server, config, credentials)
    # NOTE: what start-up created (modules, the tokenizer, Ray's and grpc's
    # state) lives as long as the process.  Frozen, it is left out of the
    # garbage collector's full collections, which would otherwise walk all of
    # it every few thousand messages and stall every stream for ~0.1 s.
    gc.freeze()
    frontend.start()
    await server.start()
    await set_serving(True)
    logger.info("serving %s on %s:%d", GENERATION_SERVICE, config.host, port)
    return GenerationServer(server, port, frontend, health_servicer, scheduler_lost)
