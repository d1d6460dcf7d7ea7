"""What ``kvserve serve`` runs once its flags are read: Ray (local or joined), then the
gRPC and HTTP servers until SIGINT, SIGTERM or the loss of the scheduler actor."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.cluster.config import ClusterConfig, ServerConfig
    from kvserve.cluster.launcher import ClusterHandle

# How long `serve` lets the streams in flight finish once told to stop.
SHUTDOWN_GRACE_S = 5.0


def check_local_gpus(config: ClusterConfig) -> None:
    """``RuntimeError`` when ``--device cuda`` asks a local cluster for more GPUs than this machine has, or
    ``--attention-backend cuda`` is given for replicas that will run on CPU.

    NOTE: only for the local cluster serve starts itself: a joined cluster may gain GPU
    nodes as it scales up, so there the replicas wait for their placement (and its timeout).
    """
    runtime = config.engine.runtime
    if config.simulation is not None:
        return
    if runtime.attention_backend == "cuda" and _local_replicas_on_cpu(config):
        raise RuntimeError(
            "--attention-backend cuda needs the replicas on a GPU, and they run on CPU here "
            f"({'--device cpu' if runtime.device == 'cpu' else 'this machine has no GPU'}): leave it out, or "
            "give --device cuda on a machine with GPUs (or --address to join a cluster with them)"
        )
    if runtime.device != "cuda":
        return
    import torch

    needed = config.parallel.num_workers
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < needed:
        raise RuntimeError(
            f"--device cuda needs {needed} GPU(s) ({config.parallel.num_replicas} replica(s) x TP "
            f"{config.parallel.tensor_parallel_size}), and this machine has {visible} "
            f"(torch {torch.__version__}, CUDA {torch.version.cuda}); use fewer replicas, --device cpu, "
            f"or --address to join a cluster with GPUs"
        )


def _local_replicas_on_cpu(config: ClusterConfig) -> bool:
    """Whether a local cluster's (unsimulated) replicas run on CPU: ``--device cpu``, or no device given
    on a machine without a GPU."""
    device = config.engine.runtime.device
    if device is not None:
        return device == "cpu"
    import torch

    return not torch.cuda.is_available()


def init_ray(address: str | None, config: ClusterConfig, progress: Callable[[str], None]) -> None:
    from kvserve.cluster.launcher import init_local_ray, join_ray, ray_status_command

    if address is not None:
        gcs_address = join_ray(address)
        joined = address if address == gcs_address else f"{address} ({gcs_address})"
        progress(f"joined the Ray cluster at {joined}")
        return

    num_worker_slots = 0
    if config.simulation is not None or _local_replicas_on_cpu(config):
        num_worker_slots = config.parallel.num_workers
    progress("starting a local Ray instance")
    gcs_address = init_local_ray(num_worker_slots, report=progress)
    progress(f"started a local Ray instance at {gcs_address} (its status: {ray_status_command(gcs_address)})")


async def serve_until_signalled(
    handle: ClusterHandle, server_config: ServerConfig, progress: Callable[[str], None], chat_template: str | None
) -> int:
    """Serve until SIGINT or SIGTERM (0), or until the scheduler actor dies (1: nothing can serve)."""
    import asyncio
    import signal

    from kvserve.cluster.server import start_server

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = await start_server(handle.scheduler, handle.model_info, server_config)
    http_server = None
    try:
        if server_config.http_port is not None:
            from kvserve.cluster.http_server import start_http_server

            http_server = await start_http_server(server.frontend, server_config, chat_template=chat_template)
            progress(f"OpenAI-compatible API at {api_url(server_config, http_server.port)}")
        progress(f"listening on {server_config.host}:{server.port} (Ctrl-C to stop)")
        stopped = asyncio.ensure_future(stop.wait())
        lost = asyncio.ensure_future(server.scheduler_lost.wait())
        await asyncio.wait((stopped, lost), return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        lost.cancel()
        if server.scheduler_lost.is_set():
            print(
                "kvserve serve: error: the scheduler actor died, and with it every request in flight; "
                "stopping so that a supervisor can start the server again",
                file=sys.stderr,
            )
            return 1
        progress(f"stopping: finishing the streams in flight (for at most {SHUTDOWN_GRACE_S:g} s)")
        return 0
    finally:
        # Both front doors at once: the gRPC server's stop ends every stream left after the grace.
        stopping = [server.stop(grace_s=SHUTDOWN_GRACE_S)]
        if http_server is not None:
            stopping.insert(0, http_server.stop(grace_s=SHUTDOWN_GRACE_S))
        await asyncio.gather(*stopping)


def api_url(server_config: ServerConfig, http_port: int) -> str:
    """The base URL of the OpenAI-compatible API: https when the server speaks TLS."""
    scheme = "https" if server_config.tls is not None else "http"
    return f"{scheme}://{_url_host(server_config.host)}:{http_port}/v1"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host

