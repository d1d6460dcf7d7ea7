"""Starting and stopping a cluster on an already initialised Ray.

The launcher creates the scheduler actor; the scheduler actor launches its
own replicas (placement group and worker actors per replica, then the gRPC
channels of its executor).  NOTE: replicas are launched *inside* the actor,
not here, because a replica's executor holds grpc.aio channels bound to the
event loop that uses them (the actor's), and because the worker actors are
then owned by the scheduler actor: they fate-share with it, so killing the
scheduler can never leave orphaned workers holding GPUs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvserve.cluster.config import ClusterConfig
from kvserve.cluster.interrupts import interrupts_deferred
from kvserve.cluster.messages import ModelInfo
from kvserve.cluster.placement import DeviceKind, describe_shortfall, replica_bundles
from kvserve.cluster.ray_address import check_gcs_reachable
from kvserve.cluster.ray_errors import remote_error_message
from kvserve.cluster.scheduler_actor import SCHEDULER_ACTOR_NAME, SchedulerActor
from kvserve.cluster.ray_loopback import keep_ray_on_loopback
from kvserve.cluster.worker_actor import RAY_NAMESPACE, WORKER_CPU_RESOURCE
from kvserve.worker.host_address import is_loopback
from kvserve.worker.model_config import ModelConfig

logger = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 20.0
# How often start_cluster says what the replicas still starting wait for.
_STILL_WAITING_S = 60.0
# How long that message waits for the scheduler to say which of them are placed.
_PLACED_QUERY_TIMEOUT_S = 10.0
# How often a shutdown waiting on the scheduler checks that Ray itself still runs.
_LOST_RAY_CHECK_S = 0.5


@dataclass(frozen=True, slots=True)
class ClusterHandle:
    """A running cluster: its scheduler actor and what the front end needs of the model."""

    scheduler: Any
    model_info: ModelInfo
    config: ClusterConfig
    device_kind: str
    placement_groups: tuple[PlacementGroup, ...]

    def shutdown(self, timeout_s: float = _SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the replicas (worker actors, placement groups), then the scheduler actor."""
        _stop(self.scheduler, self.placement_groups, timeout_s)


def start_cluster(config: ClusterConfig, *, progress: Callable[[str], None] | None = None) -> ClusterHandle:
    """Start the scheduler actor and every replica; returns once all replicas serve.

    The caller has called ``ray.init``.  ``progress`` receives one line per
    stage (for a command line to show).  ``ValueError`` for a model directory
    that cannot be served; ``RuntimeError`` when a cluster already runs in the
    ``kvserve`` namespace or a replica fails to start (nothing is left behind).
    """
    report = progress or (lambda line: logger.info("%s", line))
    model_config = resolve_model_config(config)
    config = resolve_simulation(config, model_config)
    device_kind = resolve_device_kind(config)
    if _scheduler_exists():
        raise RuntimeError(f"a {SCHEDULER_ACTOR_NAME!r} actor already runs in Ray namespace {RAY_NAMESPACE!r}")
    parallel = config.parallel
    kind = "simulated" if config.simulation is not None else device_kind.upper()
    report(
        f"starting {parallel.num_replicas} replica(s) x TP {parallel.tensor_parallel_size} "
        f"on {kind} ({model_config.architecture}, max_model_len {model_config.max_model_len})"
    )
    scheduler = (
        ray.remote(SchedulerActor)
        .options(
            name=SCHEDULER_ACTOR_NAME,
            namespace=RAY_NAMESPACE,
            # It waits on the network and the workers; it needs no core of its own.
            num_cpus=0,
            max_restarts=0,
            # NOTE: Ray's GCS would keep a record of every call (3-4 per request served: adds, polls,
            # aborts), about 11 KB each, up to 100,000 of them: its memory grew without bound in a soak.
            enable_task_events=False,
            # Next to the front end (this process), whose every poll it answers.
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True),
        )
        # Its log lines at this process's level (`kvserve serve --log-level`).
        .remote(config, model_config, log_level=logging.getLogger(__name__).getEffectiveLevel())
    )
    try:
        pending = {
            scheduler.start_replica.remote(replica_id, device_kind): replica_id
            for replica_id in range(parallel.num_replicas)
        }
        started = time.monotonic()
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=_STILL_WAITING_S)
            if not ready:
                # NOTE: joining a cluster, placement waits without limit (an
                # autoscaler may be adding the nodes): say what for, now and then.
                report(_still_waiting(scheduler, sorted(pending.values()), config, device_kind, started))
                continue
            [done] = ready
            replica_id = pending.pop(done)
            stats = ray.get(done)
            report(replica_ready_line(replica_id, stats.num_kv_blocks))
        model_info = ray.get(scheduler.ready.remote())
        placement_groups = tuple(ray.get(scheduler.placement_groups.remote()))
    except BaseException as exc:
        # NOTE: a replica that failed to start removed its own placement group;
        # the scheduler's shutdown releases those of the replicas that did start.
        _stop(scheduler, (), _SHUTDOWN_TIMEOUT_S)
        if isinstance(exc, Exception):
            raise RuntimeError(f"the cluster failed to start: {remote_error_message(exc)}") from exc
        raise
    return ClusterHandle(scheduler, model_info, config, device_kind, placement_groups)


def replica_ready_line(replica_id: int, num_kv_blocks: int) -> str:
    """The progress line of a replica that started with ``num_kv_blocks`` blocks in its pool.

    NOTE: the pool's first block is the null block, which holds no tokens: the line counts the
    usable ones, as the fleet's description and the results table do.
    """
    return f"replica {replica_id} ready ({num_kv_blocks - 1} usable KV blocks)"


def _still_waiting(
    scheduler: Any, replica_ids: list[int], config: ClusterConfig, device_kind: str, started: float
) -> str:
    """What the replicas ``replica_ids`` still wait for: their workers (placed: loading the model), or
    resources (not placed: what each needs, against what the nodes have)."""
    parallel = config.parallel
    try:
        placed = set(ray.get(scheduler.placed_replicas.remote(), timeout=_PLACED_QUERY_TIMEOUT_S))
    except Exception as exc:  # noqa: BLE001 - the message then says what it knows
        logger.debug("placed replicas: %s", remote_error_message(exc))
        placed = set()
    loading = [r for r in replica_ids if r in placed]
    unplaced = [r for r in replica_ids if r not in placed]
    parts = []
    if loading:
        parts.append(f"{_replica_list(loading)} placed, starting their workers (loading the model)")
    if unplaced:
        bundles = replica_bundles(parallel.tensor_parallel_size, DeviceKind(device_kind))
        parts.append(
            f"{_replica_list(unplaced)} waiting for resources: each {describe_shortfall(bundles).removeprefix('it ')}"
        )
    return (
        f"still waiting for {len(replica_ids)} of {parallel.num_replicas} replica(s) after "
        f"{time.monotonic() - started:.0f} s: " + "; ".join(parts)
    )


def _replica_list(replica_ids: list[int]) -> str:
    return ("replica " if len(replica_ids) == 1 else "replicas ") + ", ".join(map(str, replica_ids))


def init_local_ray(num_worker_slots: int = 0, report: Callable[[str], None] | None = None) -> str:
    """Start a new single-machine Ray instance on 127.0.0.1 (namespace ``kvserve``); returns its GCS
    address (``host:port``: see ``ray_status_command``).

    ``num_worker_slots``: the ``WORKER_CPU_RESOURCE`` slots it offers, one per
    CPU (or simulated) rank.  Ctrl-C or SIGTERM while Ray starts (seconds) is
    held until it has started, which is then stopped and ``KeyboardInterrupt``
    raised; ``report``, when given, is told so when the signal comes.
    """
    keep_ray_on_loopback()
    plain_actor_logs_off_a_terminal()
    resources = {WORKER_CPU_RESOURCE: num_worker_slots} if num_worker_slots else {}
    # NOTE: an interrupt inside ray.init left Ray's dashboard and runtime-env
    # agents running after the process exited (they ignore SIGTERM).
    on_interrupt = None if report is None else lambda: report("interrupted: stopping once Ray has started")
    with interrupts_deferred(on_interrupt) as interrupted, _sigterm_handler_kept():
        # NOTE: address="local" always starts a new instance: without it, ray.init
        # joins whatever cluster this machine last started.
        context = ray.init(
            address="local",
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            namespace=RAY_NAMESPACE,
            resources=resources,
            logging_level=logging.WARNING,
        )
    _exit_on_unhandled_sigterm()
    if interrupted():
        ray.shutdown()
        raise KeyboardInterrupt
    return context.address_info["gcs_address"]


def plain_actor_logs_off_a_terminal() -> None:
    """Ray prints the actors' log lines in this process with colour codes around their prefix
    (``(SchedulerActor pid=...)``): noise in a file or a journal.  Off unless both output streams are
    terminals, or the environment chose (``RAY_COLOR_PREFIX``)."""
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


# What the ray CLI, in another shell, needs to reach the instance that init_local_ray started: that it
# keep to loopback addresses (keep_ray_on_loopback) and send Ray's token (ray.init sets "token" when the
# cluster wants one, the default of new clusters in recent Ray); ray.init sets both in this process.
_RAY_CLI_ENV = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE")


def ray_status_command(gcs_address: str) -> str:
    """The shell command that shows the status of this process's Ray instance at ``gcs_address``."""
    env = [f"{name}={os.environ[name]}" for name in _RAY_CLI_ENV if os.environ.get(name)]
    return " ".join([*env, "ray status --address", gcs_address])


# What ray.init(address="auto") says when no cluster runs on this machine (Ray 2.x).
_NO_RAY_INSTANCE = "Could not find any running Ray instance"


def join_ray(address: str) -> str:
    """Connect to the running Ray cluster at ``address`` ('auto' or HOST:PORT), namespace ``kvserve``;
    returns its GCS address (``host:port``).

    ``ConnectionError`` at once when nothing listens at HOST:PORT (``ray.init``
    would retry for minutes), ``ValueError`` for a malformed address.
    """
    gcs = check_gcs_reachable(address)
    if gcs is not None and is_loopback(gcs[0]):
        # A cluster on this machine's loopback: Ray would otherwise connect to
        # the host's routable address instead (see ray_loopback).
        keep_ray_on_loopback()
    plain_actor_logs_off_a_terminal()
    with _sigterm_handler_kept():
        try:
            context = ray.init(address=address, namespace=RAY_NAMESPACE, logging_level=logging.WARNING)
        except ConnectionError as exc:
            if gcs is None and _NO_RAY_INSTANCE in str(exc):
                # 'auto' found no cluster on this machine: no token would help.
                raise ConnectionError(
                    f"--address {address}: no Ray cluster is running on this machine (`ray start --head` "
                    "starts one; without --address a local one is started and stopped with the command)"
                ) from exc
            if os.environ.get("RAY_AUTH_MODE") is None:
                # NOTE: Ray sends its token to a cluster named by address only when told to; a
                # cluster with token authentication (new clusters' default in recent Ray) refuses it otherwise.
                raise ConnectionError(
                    f"{exc}; if that cluster uses token authentication, set RAY_AUTH_MODE=token "
                    "(and RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH, unless the token is in ~/.ray/auth_token)"
                ) from exc
            # A wrong token reads the same as no cluster (Ray only warns while it retries).
            raise ConnectionError(f"{exc}; check that this process has the cluster's token ({_token_source()})") from exc
    _exit_on_unhandled_sigterm()
    return context.address_info["gcs_address"]


def _token_source() -> str:
    """Where Ray reads this process's token from, in Ray's order (never the token itself)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN is set"
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"RAY_AUTH_TOKEN_PATH={os.environ['RAY_AUTH_TOKEN_PATH']}"
    return "read from ~/.ray/auth_token: neither RAY_AUTH_TOKEN nor RAY_AUTH_TOKEN_PATH is set"


@contextlib.contextmanager
def _sigterm_handler_kept() -> Iterator[None]:
    """Within the block ``ray.init`` leaves the SIGTERM handler as it is.

    NOTE: ray.init first installs a SIGTERM handler that calls ``sys.exit(15)``
    (through the private ``ray._private.utils.set_sigterm_handler``, stubbed
    here): a SIGTERM in the seconds it started Ray then cut it short and left
    Ray's agents running, and ``serve``'s own handler (SIGTERM as Ctrl-C) was
    gone.  If Ray no longer has that function, the block runs as is.
    """
    import ray._private.utils as ray_utils

    original = getattr(ray_utils, "set_sigterm_handler", None)
    if original is None:
        yield
        return
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = original


def _exit_on_unhandled_sigterm() -> None:
    """Where nothing handles SIGTERM, what ray.init would have set: exit (atexit then stops Ray)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))


def resolve_model_config(config: ClusterConfig) -> ModelConfig:
    """The served model as the scheduler and the front end see it; ``ValueError`` for a bad directory,
    one the tensor-parallel size cannot split, or scheduler limits that cannot serve its
    ``max_model_len`` (chunked prefill off with a smaller token budget).

    A simulated cluster runs no model, so its ``max_model_len`` may exceed the
    model's position limit, and its replicas split nothing.
    """
    if config.simulation is None:
        model_config = ModelConfig.from_pretrained(config.engine.model, config.engine.scheduler.max_model_len)
        model_config.check_tensor_parallel_size(config.parallel.tensor_parallel_size)
    else:
        model_config = ModelConfig.from_pretrained(config.engine.model)
        if config.engine.scheduler.max_model_len is not None:
            model_config = dataclasses.replace(model_config, max_model_len=config.engine.scheduler.max_model_len)
    # NOTE: else refused by the scheduler actor, after Ray and the replicas had started.
    config.engine.scheduler_config(model_config.max_model_len)
    return model_config


def resolve_simulation(config: ClusterConfig, model_config: ModelConfig) -> ClusterConfig:
    """``config`` with its simulated vocabulary resolved to the model's (``ValueError`` if larger)."""
    simulation = config.simulation
    if simulation is None:
        return config
    vocab_size = model_config.vocab_size
    if simulation.vocab_size is not None and simulation.vocab_size > vocab_size:
        raise ValueError(
            f"simulation.vocab_size {simulation.vocab_size} exceeds the model's vocabulary of {vocab_size}"
        )
    if simulation.vocab_size is None:
        return dataclasses.replace(config, simulation=dataclasses.replace(simulation, vocab_size=vocab_size))
    return config


def resolve_device_kind(config: ClusterConfig) -> str:
    """``"gpu"`` or ``"cpu"``: the configured device, else GPUs when the Ray cluster has any.

    Simulated replicas take CPU worker slots, never a GPU.
    """
    if config.simulation is not None:
        return "cpu"
    if config.engine.runtime.device is not None:
        return "gpu" if config.engine.runtime.device == "cuda" else "cpu"
    return "gpu" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"


def local_ray_lost() -> bool:
    """Whether the Ray instance this process started has lost its GCS server, its raylet or its
    log monitor.

    NOTE: a signal sent to ``serve``'s whole process group (``timeout``,
    ``kill -- -PGID``, a service manager stopping a unit) reaches the Ray
    processes ``ray.init`` started too, and SIGTERM stops them: the log monitor
    and the dashboard at once (0.1 s), the raylet some 10 s later while this
    driver is still connected, the GCS server not before the driver exits
    (measured on Ray 2.60).  Nothing can then be stopped through Ray (the actors
    go with the raylet), and the driver's core worker waits 60 s for the GCS
    before it ends the process with an error.  The log monitor is the early sign:
    it runs until Ray stops and needs none of the dashboard's optional packages.
    Once the driver exits, the kernel stops the rest (Ray starts them to die with
    their parent).  ``False`` for a joined cluster (this process started none of
    it), or where Ray's private node handle is not where Ray 2 keeps it.
    """
    import ray._private.worker as ray_worker
    from ray._private import ray_constants

    node = getattr(ray_worker, "_global_node", None)
    processes = getattr(node, "all_processes", None) or {}
    kinds = (ray_constants.PROCESS_TYPE_GCS_SERVER, ray_constants.PROCESS_TYPE_RAYLET, ray_constants.PROCESS_TYPE_LOG_MONITOR)
    for kind in kinds:
        for info in processes.get(kind, ()):
            process = getattr(info, "process", None)
            if process is not None and process.poll() is not None:
                return True
    return False


def _stop(scheduler: Any, placement_groups: tuple[PlacementGroup, ...], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        # A replica started again after a failure has a placement group of its own.
        placement_groups = (*placement_groups, *ray.get(scheduler.placement_groups.remote(), timeout=_LOST_RAY_CHECK_S))
    except Exception as exc:  # noqa: BLE001 - a dead or hung scheduler: the groups known at start
        logger.debug("placement groups of the running replicas: %s", remote_error_message(exc))
    try:
        done = scheduler.shutdown.remote()
        # In slices, so that a Ray instance stopped underneath (local_ray_lost) is not waited out.
        while not ray.wait([done], timeout=min(_LOST_RAY_CHECK_S, max(deadline - time.monotonic(), 0)))[0]:
            if local_ray_lost():
                logger.info("Ray's own processes have stopped: the replicas stopped with them")
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no answer in {timeout_s:g} s")
        ray.get(done)
    except RayActorError as exc:
        # NOTE: the front end logged Ray's ~10 lines on the actor's death when it happened.
        logger.warning("the scheduler did not shut down: its actor was dead already (%s)", type(exc).__name__)
        logger.debug("the scheduler actor's death: %s", remote_error_message(exc))
    except Exception as exc:  # noqa: BLE001 - kill it regardless
        logger.warning("the scheduler did not shut down cleanly: %s", remote_error_message(exc))
    # The worker actors are owned by the scheduler actor and die with it;
    # placement groups would outlive it (until this driver exits).
    ray.kill(scheduler, no_restart=True)
    for group in placement_groups:
        try:
            remove_placement_group(group)
        except Exception as exc:  # noqa: BLE001 - already removed by the scheduler's own shutdown
            logger.debug("placement group %s: %s", group.id, exc)


def _scheduler_exists() -> bool:
    try:
        ray.get_actor(SCHEDULER_ACTOR_NAME, namespace=RAY_NAMESPACE)
    except ValueError:
        return False
    return True
