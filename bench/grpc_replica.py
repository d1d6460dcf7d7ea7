"""One replica over the step protocol, without Ray: a worker server in a child process, driven from here.

The cluster replica's data path, minus Ray and the client-facing front end::

    this process:   EngineCore(Scheduler, GrpcReplicaExecutor)   begin_step(), await run_step_async(plan)
                        │ ExecuteSteps stream, loopback 127.0.0.1
    child process:  StepWorker server (start_step_server) ─▶ Worker (kvserve.worker.worker)

The loop is the scheduler actor's step loop (``cluster.scheduler_actor``), with the
requests added up front and no router, Ray actor or client stream: it is not
``kvserve serve``.  The child is spawned (a fresh interpreter: safe with CUDA in this
process) and builds its ``Worker`` on the thread that serves the RPCs, as a worker
actor does (``cluster.worker_actor``).
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import secrets
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

from kvserve.cluster.replica_client import GrpcReplicaExecutor
from kvserve.cluster.step_servicer import StepRunner, start_step_server
from kvserve.scheduler.engine_config import EngineConfig
from kvserve.scheduler.engine_core import EngineCore
from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler
from kvserve.worker.model_config import ModelConfig

LOOPBACK = "127.0.0.1"
_JOIN_TIMEOUT_S = 30.0


@contextmanager
def worker_server(
    config: Any, start_timeout_s: float = 600.0, runner: Callable[[Any], StepRunner] | None = None
) -> Iterator[tuple[str, str]]:
    """A StepWorker server around a ``Worker`` of ``config`` (a ``WorkerConfig``), or around
    ``runner(config)`` (both picklable: a benchmark's stand-in), in a spawned child process on
    loopback; yields its ``host:port`` and the secret its callers must carry.  Leaving the
    block stops the server and the process.

    ``RuntimeError`` if the server is not up within ``start_timeout_s`` (the worker loads the
    model, and on CUDA captures its graphs, first) or the child dies first (its traceback is
    on this process's stderr).
    """
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    secret = secrets.token_urlsafe(32)
    process = context.Process(target=_serve, args=(child, config, secret, runner), daemon=True,
                              name="kvserve-step-worker")
    process.start()
    child.close()
    try:
        if not parent.poll(start_timeout_s):
            raise RuntimeError(f"the StepWorker server did not start within {start_timeout_s:g} s")
        try:
            address = parent.recv()
        except EOFError:
            process.join(_JOIN_TIMEOUT_S)
            exitcode = process.exitcode
            raise RuntimeError(f"the StepWorker server process exited (code {exitcode}) before serving") from None
        yield address, secret
    finally:
        parent.close()  # the child's signal to stop
        process.join(_JOIN_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()


def _serve(conn: Connection, config: Any, secret: str, runner: Callable[[Any], StepRunner] | None) -> None:
    """Child process: build the worker, serve it, send the address; stop when the pipe closes."""
    if runner is None:
        from kvserve.worker.worker import Worker as runner

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-step-worker")
        worker = await loop.run_in_executor(thread, runner, config)
        server, address = await start_step_server(worker, thread, LOOPBACK, secret=secret)
        conn.send(address)
        try:
            await loop.run_in_executor(None, _wait_for_close, conn)
        finally:
            await server.stop(grace=None)

    asyncio.run(serve())


def _wait_for_close(conn: Connection) -> None:
    try:
        conn.recv_bytes()
    except EOFError:
        pass


class StepProtocolReplica:
    """Drives a single-rank replica at ``address`` (its server's ``secret``) over the step protocol from this process.

    ``engine_config`` and ``model_config`` are the in-process ``LLM``'s (``llm.config``,
    ``llm.model_config``): the same scheduler settings make the same plans.  The engine runs
    on an event loop of its own (``grpc.aio`` channels belong to their loop); ``close()``
    shuts the rank's worker down and closes the channel.
    """

    def __init__(self, address: str, secret: str, engine_config: EngineConfig, model_config: ModelConfig) -> None:
        self._loop = asyncio.new_event_loop()
        self._model_config = model_config
        self._req_ids = itertools.count()
        self.engine = self._loop.run_until_complete(self._connect(address, secret, engine_config))

    async def _connect(self, address: str, secret: str, engine_config: EngineConfig) -> EngineCore:
        executor = GrpcReplicaExecutor(0, [address], secret=secret)
        num_blocks = await executor.initialize_cache()
        model = self._model_config
        scheduler = Scheduler(
            engine_config.scheduler_config(model.max_model_len), engine_config.cache_config(num_blocks, model.model_id)
        )
        return EngineCore(scheduler, executor)

    def generate(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams]) -> list[list[int]]:
        """Every prompt's output token ids, in prompt order (``engine.async_scheduling`` as set)."""
        requests = [
            Request(f"grpc-{next(self._req_ids)}", list(prompt), p, eos_token_ids=self._model_config.eos_token_ids)
            for prompt, p in zip(prompts, params)
        ]
        for request in requests:
            self.engine.add_request(request)
        self._loop.run_until_complete(self._run_until_done())
        return [list(request.output_token_ids) for request in requests]

    async def _run_until_done(self) -> None:
        engine = self.engine
        while engine.has_unfinished_requests():
            plan = engine.begin_step()
            if plan is None and not engine.step_in_flight:
                raise RuntimeError("requests are waiting, and the scheduler planned no step")
            # With async scheduling: launch this plan, apply the one launched before.
            await engine.run_step_async(plan)

    def close(self) -> None:
        try:
            self._loop.run_until_complete(self.engine.executor.shutdown())  # type: ignore[union-attr]
        finally:
            self._loop.close()
