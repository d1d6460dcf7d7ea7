"""The gRPC server (and the HTTP one beside it) on its own event loop thread, as ``kvserve serve``
runs them, for in-process tests; and a wait until that server's replicas are idle."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvserve.cluster.client import Client

from kvserve.cluster.config import ServerConfig
from kvserve.cluster.http_server import HttpServer, start_http_server
from kvserve.cluster.launcher import ClusterHandle
from kvserve.cluster.server import GenerationServer, start_server

CALL_TIMEOUT_S = 60.0


class ServerThread:
    """The gRPC server on its own event loop thread, as ``kvserve serve`` runs it; ``start_http``
    adds the HTTP server on the same loop, and ``stop`` stops both."""

    def __init__(self, handle: ClusterHandle, config: ServerConfig) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-server", daemon=True)
        self._thread.start()
        self.server: GenerationServer = self._run(start_server(handle.scheduler, handle.model_info, config))
        self.http: HttpServer | None = None

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=CALL_TIMEOUT_S)

    def pause_front_end(self) -> None:
        """Stop fetching outputs from the scheduler, as a front end that hangs would."""
        self._run(self.server.frontend.stop())

    def resume_front_end(self) -> None:
        self._loop.call_soon_threadsafe(self.server.frontend.start)

    def start_http(self, config: ServerConfig) -> HttpServer:
        """The OpenAI-compatible HTTP server of ``config`` over this server's front end."""
        self.http = self._run(start_http_server(self.server.frontend, config))
        return self.http

    def stop(self) -> None:
        if self.http is not None:
            self._run(self.http.stop(grace_s=1.0))
        self._run(self.server.stop(grace_s=1.0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def wait_until_idle(client: Client, timeout_s: float) -> None:
    """Until no replica the ``client``'s server reaches runs, queues or holds anything."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.get_stats()
        if not any(s.num_running or s.num_waiting or s.kv_cache_usage for s in stats):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the replica is still busy after {timeout_s} s: {stats}")
        time.sleep(0.05)
