"""Benchmark 7a: the cost of one step on the step protocol, gRPC against a Ray actor call.

One step of 256 decode requests whose 64-block tables (block size 16) were
sent in earlier steps: 256 tokens and a few new block ids (one request in
16 crosses into a new block).  Variant: the same 256 requests all new, so
the plan carries every sampling parameter and the full block tables.

gRPC path, exactly the cluster's code: ``GrpcReplicaExecutor.execute``
(encode, serialize once, send over loopback as the next message of the
rank's open ``ExecuteSteps`` stream) to a ``StepWorkerServicer`` in another
process (parse and decode on the stream's reader thread, then on its worker thread
``InputBatch.apply`` + ``prepare``: the tensors of the forward pass), and back (256 sampled tokens,
decoded).  Baseline, in the same run: a Ray actor
call carrying the same ``StepPlan`` dataclass to an actor that does the same
``apply`` + ``prepare`` and returns the ``StepResult``.  No model runs.
Both are measured again with workers that skip ``apply`` + ``prepare``: the
protocol alone.  The two paths alternate in rounds, so that on a shared
machine both see the same load.

    python -m kvserve.bench.step_protocol [--steps N] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import pickle
import secrets
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from kvserve.bench.arg_types import int_at_least
from kvserve.experiments.report import format_table
from kvserve.cluster.replica_client import GrpcReplicaExecutor
from kvserve.cluster.step_codec import decode_plan, encode_plan
from kvserve.proto import step_pb2
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.step_plan import NewRequestData, StepPlan
from kvserve.scheduler.step_result import StepResult

NUM_REQS = 256
BLOCKS_PER_REQ = 64
BLOCK_SIZE = 16
# One request in this many crosses into a new block in the decode step.
NEW_BLOCK_EVERY = 16
TARGET_US = 1000.0


def _req_id(i: int) -> str:
    return f"req-{i:04d}"


def _block_table(i: int) -> list[int]:
    return list(range(1 + i * (BLOCKS_PER_REQ + 1), 1 + i * (BLOCKS_PER_REQ + 1) + BLOCKS_PER_REQ))


def new_requests_plan(step_id: int = 0) -> StepPlan:
    """All 256 requests new: full 64-block tables, the last token of each context."""
    params = SamplingParams(max_tokens=4096, temperature=0.8, top_p=0.95, top_k=50, seed=7)
    context_len = BLOCKS_PER_REQ * BLOCK_SIZE
    return StepPlan(
        step_id=step_id,
        req_ids=[_req_id(i) for i in range(NUM_REQS)],
        num_scheduled_tokens=[1] * NUM_REQS,
        num_computed_tokens=[context_len - 1] * NUM_REQS,
        token_ids=[(7 * i) % 32_000 for i in range(NUM_REQS)],
        num_new_block_ids=[BLOCKS_PER_REQ] * NUM_REQS,
        new_block_ids=[block for i in range(NUM_REQS) for block in _block_table(i)],
        sample=[True] * NUM_REQS,
        new_requests=[NewRequestData(_req_id(i), params, context_len - 200) for i in range(NUM_REQS)],
        finished_req_ids=[],
        preempted_req_ids=[],
    )


def decode_step_plan(step_id: int = 1) -> StepPlan:
    """256 running decodes; every 16th one's token opens its 65th block."""
    crosses = [i % NEW_BLOCK_EVERY == 0 for i in range(NUM_REQS)]
    context_len = BLOCKS_PER_REQ * BLOCK_SIZE
    return StepPlan(
        step_id=step_id,
        req_ids=[_req_id(i) for i in range(NUM_REQS)],
        num_scheduled_tokens=[1] * NUM_REQS,
        num_computed_tokens=[context_len if cross else context_len - 1 for cross in crosses],
        token_ids=[(11 * i) % 32_000 for i in range(NUM_REQS)],
        num_new_block_ids=[int(cross) for cross in crosses],
        new_block_ids=[(i + 1) * (BLOCKS_PER_REQ + 1) for i in range(NUM_REQS) if crosses[i]],
        sample=[True] * NUM_REQS,
        new_requests=[],
        finished_req_ids=[],
        preempted_req_ids=[],
    )


class BenchWorker:
    """A worker without a model: keeps the ``InputBatch`` and builds each step's tensors
    (or, with ``prepare=False``, only answers).

    So that every timed step finds the same state, a decode step's new blocks
    are taken off the tables again after ``prepare`` (16 row lengths reset).
    """

    def __init__(self, prepare: bool) -> None:
        import torch

        from kvserve.worker.input_batch import InputBatch

        # The same in both processes (Ray sets 1 for its actors anyway): these
        # small host tensors gain nothing from threads, which only spin.
        torch.set_num_threads(1)
        self.prepare = prepare
        self.input_batch = InputBatch(BLOCK_SIZE, torch.device("cpu"))

    def determine_num_blocks(self) -> int:
        return NUM_REQS * (BLOCKS_PER_REQ + 1) + 1

    def initialize_cache(self, num_blocks: int) -> None:
        pass

    def execute(self, plan: StepPlan) -> StepResult:
        if self.prepare:
            batch = self.input_batch
            batch.apply(plan)
            batch.prepare(plan)
            if not plan.new_requests:
                for req_id, count in zip(plan.req_ids, plan.num_new_block_ids):
                    if count:
                        batch.num_blocks[batch.requests[req_id].row] = BLOCKS_PER_REQ
        num_sampled = plan.num_sampled
        return StepResult(plan.step_id, [17] * num_sampled)

    def shutdown(self) -> None:
        pass

    def cpu_time(self) -> float:
        """CPU seconds of this whole process so far (every thread)."""
        return time.process_time()


# -- the two paths -----------------------------------------------------------------------


def _serve_grpc(conn: Connection, prepare: bool, secret: str) -> None:
    """Child process: a StepWorker server around a ``BenchWorker``, taking calls that carry ``secret``.

    The pipe asks for the process's CPU time (any message) until it closes.
    """
    from kvserve.cluster.step_servicer import start_step_server

    async def serve() -> None:
        worker = BenchWorker(prepare)
        server, address = await start_step_server(worker, ThreadPoolExecutor(max_workers=1), "127.0.0.1", secret=secret)
        conn.send(address)
        loop = asyncio.get_running_loop()
        while True:
            try:
                await loop.run_in_executor(None, conn.recv_bytes)
            except EOFError:  # the parent closed the pipe: done
                break
            conn.send(worker.cpu_time())
        await server.stop(grace=None)

    asyncio.run(serve())


@contextmanager
def grpc_worker(prepare: bool) -> Iterator[tuple[str, str, Callable[[], float]]]:
    """A StepWorker server in a child process; yields its address, its secret and its CPU clock."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    secret = secrets.token_urlsafe(32)
    server = ctx.Process(target=_serve_grpc, args=(child, prepare, secret), daemon=True)
    server.start()
    child.close()

    def cpu_time() -> float:
        parent.send_bytes(b"cpu")
        return parent.recv()

    try:
        if not parent.poll(120):
            raise RuntimeError("the gRPC StepWorker server did not start")
        yield parent.recv(), secret, cpu_time
    finally:
        parent.close()
        server.join(timeout=10)
        if server.is_alive():
            server.kill()


@contextmanager
def local_ray() -> Iterator[None]:
    """A local Ray instance on 127.0.0.1 (token authentication on, Ray's default)."""
    from kvserve.cluster.ray_loopback import keep_ray_on_loopback

    keep_ray_on_loopback()
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()


@contextmanager
def ray_worker(prepare: bool) -> Iterator[object]:
    import ray

    actor = ray.remote(num_cpus=0)(BenchWorker).remote(prepare)
    try:
        yield actor
    finally:
        ray.kill(actor)


async def _connect(address: str, secret: str) -> GrpcReplicaExecutor:
    executor = GrpcReplicaExecutor(0, [address], secret=secret)
    await executor.initialize_cache()
    return executor


async def _time_grpc_steps(executor: GrpcReplicaExecutor, plan: StepPlan, num_steps: int) -> list[float]:
    samples = []
    for _ in range(num_steps):
        start = time.perf_counter()
        result = await executor.execute(plan)
        samples.append(time.perf_counter() - start)
    _check(result, "gRPC")
    return samples


def _time_ray_steps(actor, plan: StepPlan, num_steps: int) -> list[float]:
    import ray

    samples = []
    for _ in range(num_steps):
        start = time.perf_counter()
        result = ray.get(actor.execute.remote(plan))
        samples.append(time.perf_counter() - start)
    _check(result, "Ray")
    return samples


def _check(result: StepResult, path: str) -> None:
    if len(result.sampled_token_ids) != NUM_REQS:
        raise RuntimeError(f"the {path} worker sampled {len(result.sampled_token_ids)} tokens, not {NUM_REQS}")


@dataclass(slots=True)
class PathTimings:
    """One path's steps: wall time of each, and the CPU time spent on both sides."""

    wall_s: list[float] = field(default_factory=list)
    driver_cpu_s: float = 0.0
    worker_cpu_s: float = 0.0

    @property
    def median_us(self) -> float:
        return statistics.median(self.wall_s) * 1e6

    @property
    def best_us(self) -> float:
        return min(self.wall_s) * 1e6

    @property
    def cpu_us(self) -> float:
        return (self.driver_cpu_s + self.worker_cpu_s) / len(self.wall_s) * 1e6

    def measure(self, worker_cpu_time: Callable[[], float], run: Callable[[], list[float]]) -> None:
        driver_start, worker_start = time.process_time(), worker_cpu_time()
        self.wall_s += run()
        self.driver_cpu_s += time.process_time() - driver_start
        self.worker_cpu_s += worker_cpu_time() - worker_start


def steps_per_round(num_steps: int, num_rounds: int) -> int:
    """The steps each round times: ``num_steps`` shared out, the rest dropped (``ValueError`` if fewer than rounds)."""
    if num_steps < num_rounds:
        raise ValueError(f"{num_steps} steps cannot be shared among {num_rounds} rounds")
    return num_steps // num_rounds


def header(num_steps: int, num_rounds: int, num_cores: int | None, load: float) -> str:
    """The line above the table: what one cell times, in steps actually timed."""
    per_round = steps_per_round(num_steps, num_rounds)
    return (f"One step of {NUM_REQS} requests ({BLOCKS_PER_REQ} blocks of {BLOCK_SIZE} each) over loopback, "
            f"{per_round * num_rounds} steps per cell: paths alternating in {num_rounds} rounds of {per_round}; "
            f"{num_cores} cores, load average {load:.1f}")


def time_round_trips(
    plans: dict[str, StepPlan], num_steps: int, num_rounds: int, *, prepare: bool
) -> tuple[dict[str, PathTimings], dict[str, PathTimings]]:
    """Each plan on each path (``local_ray`` must be running), alternating in rounds."""
    import ray

    grpc_times = {name: PathTimings() for name in plans}
    ray_times = {name: PathTimings() for name in plans}
    per_round = steps_per_round(num_steps, num_rounds)
    loop = asyncio.new_event_loop()
    try:
        with grpc_worker(prepare) as (address, secret, grpc_cpu_time), ray_worker(prepare) as actor:
            executor = loop.run_until_complete(_connect(address, secret))
            # Register the requests and warm both paths up.
            loop.run_until_complete(_time_grpc_steps(executor, new_requests_plan(), 5))
            _time_ray_steps(actor, new_requests_plan(), 5)
            for _ in range(num_rounds):
                for name, plan in plans.items():
                    grpc_times[name].measure(
                        grpc_cpu_time, lambda: loop.run_until_complete(_time_grpc_steps(executor, plan, per_round))
                    )
                    ray_times[name].measure(
                        lambda: ray.get(actor.cpu_time.remote()), lambda: _time_ray_steps(actor, plan, per_round)
                    )
            loop.run_until_complete(executor.shutdown())
    finally:
        loop.close()
    return grpc_times, ray_times


# -- the parts, in one process ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Parts:
    message_bytes: int
    pickle_bytes: int
    encode_us: float
    decode_us: float
    prepare_us: float


def _median_cpu_us(fn: Callable[[], object], repeats: int) -> float:
    # NOTE: CPU time of this thread: the work itself, whatever else the machine runs.
    samples = []
    for _ in range(repeats):
        start = time.thread_time_ns()
        fn()
        samples.append(time.thread_time_ns() - start)
    return statistics.median(samples) / 1e3


def time_parts(plan: StepPlan, repeats: int) -> Parts:
    data = encode_plan(plan).SerializeToString()
    worker = BenchWorker(prepare=True)
    worker.execute(new_requests_plan())
    return Parts(
        message_bytes=len(data),
        pickle_bytes=len(pickle.dumps(plan, protocol=5)),
        encode_us=_median_cpu_us(lambda: encode_plan(plan).SerializeToString(), repeats),
        decode_us=_median_cpu_us(lambda: decode_plan(step_pb2.StepPlan.FromString(data)), repeats),
        prepare_us=_median_cpu_us(lambda: worker.execute(plan), repeats),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int_at_least(1), default=500,
                        help="timed steps per path, plan and worker, shared among the rounds, a remainder dropped; "
                        "at least --rounds (default 500)")
    parser.add_argument("--rounds", type=int_at_least(1), default=10, help="alternations of the two paths (default 10)")
    args = parser.parse_args(argv)
    if args.steps < args.rounds:
        parser.error(f"--steps ({args.steps}) must be at least --rounds ({args.rounds}): each round times a step or more")
    plans = {
        "256 decodes, 16 new block ids": decode_step_plan(),
        "256 new requests, 64-block tables": new_requests_plan(),
    }
    parts = {name: time_parts(plan, args.steps) for name, plan in plans.items()}
    with local_ray():
        measured = {
            prepare: time_round_trips(plans, args.steps, args.rounds, prepare=prepare) for prepare in (True, False)
        }

    print(header(args.steps, args.rounds, os.cpu_count(), os.getloadavg()[0]))
    rows = []
    for prepare, (grpc_times, ray_times) in measured.items():
        for name in plans:
            g, r = grpc_times[name], ray_times[name]
            rows.append([
                name, "apply + prepare" if prepare else "none (protocol only)",
                f"{g.median_us:.0f}", f"{g.best_us:.0f}", f"{g.cpu_us:.0f}",
                f"{r.median_us:.0f}", f"{r.best_us:.0f}", f"{r.cpu_us:.0f}",
                f"{g.median_us / r.median_us:.2f}",
            ])
    print(format_table(
        ["plan", "worker does", "gRPC median us", "gRPC best us", "gRPC CPU us",
         "Ray median us", "Ray best us", "Ray CPU us", "gRPC / Ray (median)"],
        rows,
    ))
    print("(CPU us: CPU time per step of the driver process plus the worker process, all threads)")
    print()
    print("Each part alone, median CPU time in one process:")
    print(format_table(
        ["plan", "proto bytes", "pickle bytes", "encode + serialize us", "parse + decode us", "apply + prepare us"],
        [[name, p.message_bytes, p.pickle_bytes, f"{p.encode_us:.0f}", f"{p.decode_us:.0f}", f"{p.prepare_us:.0f}"]
         for name, p in parts.items()],
    ))
    decode_name = next(iter(plans))
    g, r = measured[True][0][decode_name], measured[True][1][decode_name]
    met = g.median_us <= TARGET_US and g.median_us < r.median_us
    print()
    print(f"target (decode step, apply + prepare included): gRPC median <= {TARGET_US:.0f} us "
          f"and below the Ray call: {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
