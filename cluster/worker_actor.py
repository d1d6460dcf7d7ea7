"""One rank of one replica as a Ray actor, serving the StepWorker gRPC service.

Ray places and names the rank; the steps themselves do not go through Ray:
the scheduler sends them over gRPC straight to the actor's StepWorker
server, bound to the node's IP, which takes only calls that carry the
replica's secret (``kvserve.cluster.step_servicer``).  Lifecycle, driven by
``kvserve.cluster.replica_launcher``::

    address = await rank0.rendezvous_address.remote()     # for torch.distributed
    await asyncio.gather(*(a.start.remote(config_r, secret=secret) for each rank))   # -> "host:port"
    then DetermineNumBlocks / InitializeCache / ExecuteSteps (a stream) / Shutdown over gRPC
"""

from __future__ import annotations

import asyncio
import logging
import socket
from concurrent.futures import ThreadPoolExecutor

import ray.util

from kvserve.cluster.step_servicer import StepRunner, StepServer, join_host_port, start_step_server
from kvserve.scheduler.simulation.simulated_worker import SimulatedWorker, SimulatedWorkerConfig
from kvserve.worker.worker_config import WorkerConfig

logger = logging.getLogger(__name__)

RAY_NAMESPACE = "kvserve"
# The logical resource a worker needs on a node without GPUs: start each CPU
# node with e.g. ``resources={WORKER_CPU_RESOURCE: 2}`` to host two ranks.
WORKER_CPU_RESOURCE = "kvserve_worker_slot"


def worker_actor_name(replica_id: int, rank: int) -> str:
    """The Ray actor name of ``rank`` of ``replica_id`` (in namespace ``RAY_NAMESPACE``)."""
    return f"kvserve-worker-r{replica_id}-t{rank}"


class WorkerActor:
    """Wraps one ``Worker``: builds it on ``start`` and serves it over gRPC.

    Given a ``SimulatedWorkerConfig``, it serves a ``SimulatedWorker`` instead,
    and never imports torch (``kvserve.worker.worker`` is imported on demand):
    dozens of simulated ranks fit on one machine.

    Every call into the worker runs on one dedicated thread: torch.distributed
    collectives must come from a consistent thread, and a forward pass must
    not stall the actor's event loop (which also serves ``ping``).
    """

    def __init__(self, replica_id: int, rank: int) -> None:
        self.replica_id = replica_id
        self.rank = rank
        self._host = ray.util.get_node_ip_address()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvserve-r{replica_id}-t{rank}")
        self._worker: StepRunner | None = None
        self._server: StepServer | None = None

    async def ping(self) -> bool:
        return True

    async def rendezvous_address(self) -> str:
        """``host:port`` of a free port on this node, for rank 0's ``tcp://`` rendezvous."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((self._host, 0))
            port = sock.getsockname()[1]
        return join_host_port(self._host, port)

    async def start(self, config: WorkerConfig | SimulatedWorkerConfig, *, secret: str) -> str:
        """Build the worker (joins torch.distributed: blocks until every rank of the
        replica has called ``start``), then serve it to callers that carry ``secret``
        (the replica's); returns the server's ``host:port``."""
        if not isinstance(secret, str) or not secret:
            raise ValueError("a rank's StepWorker server needs its replica's secret")
        if self._worker is not None:
            raise RuntimeError(f"rank {self.rank} of replica {self.replica_id} is already started")
        if config.rank != self.rank:
            raise ValueError(f"actor of rank {self.rank} was given a config for rank {config.rank}")
        loop = asyncio.get_running_loop()
        if isinstance(config, SimulatedWorkerConfig):
            factory = SimulatedWorker
        else:
            from kvserve.worker.tiny_model import ensure_default_tiny_model_at
            from kvserve.worker.worker import Worker

            factory = Worker
            # `kvserve serve` without --model passes the default tiny model's path on its
            # own node; a rank on another node writes its identical copy there first.
            await loop.run_in_executor(self._thread, ensure_default_tiny_model_at, config.model_dir)
        self._worker = await loop.run_in_executor(self._thread, factory, config)
        self._server, address = await start_step_server(self._worker, self._thread, self._host, secret=secret)
        logger.info("replica %d rank %d serves steps on %s", self.replica_id, self.rank, address)
        return address
