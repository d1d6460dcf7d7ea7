"""End-to-end throughput: the cluster over gRPC against the in-process engine.

The same prompts, the same settings (one replica, TP 1, greedy, EOS
ignored, float32 CPU, the same torch threads for the model; prefix caching off,
so that repeated runs cost the same), in one run:

* in process: ``kvserve.LLM(...).generate(all prompts)`` (token ids and text);
* cluster: a local Ray instance on 127.0.0.1, ``start_cluster`` (scheduler
  actor + one worker actor), the gRPC server in this process, and a client in
  a child process that opens every ``Generate`` stream at once and reads them
  to the end, as a user would.  The clock runs from the first request sent to
  the last message received.  The cluster is measured with the server's
  default pacing of stream messages (``ServerConfig``: first tokens and the
  end at once, then at most one message per stream per interval, the
  interval growing with the streams in flight to keep within a budget of
  messages per second), with none (a message per fetch of outputs, about one
  per step), and with any fixed ``--stream-intervals``.

Both ways of scheduling are measured (``--scheduling``): plain steps, and overlapped
(async) scheduling, where each replica sends step N+1 to its workers before step N's
samples came back, so that the step protocol's round trip hides behind the model's
work.  Each has a cluster of its own, and the in-process engine beside it schedules
the same way.

The engines take turns, a run of each per round, so that on a shared machine
they see the same load; every figure is the best of ``--repeat`` rounds, and
the run fails if any stream's tokens differ from the in-process engine's.
Figures: generated tokens per second of each, their ratio (target >= 0.7 with
the server's defaults), the messages per stream, and the CPU time of every
process of each engine per generated token (on a shared machine the ratio
depends on how many cores are free; the CPU time does not).

    python -m kvserve.bench.e2e_throughput [--model DIR] [--num-requests N] [--threads T]
                                           [--scheduling plain|overlapped|both]
                                           [--stream-intervals S ...] [--repeat R]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path

from kvserve.bench.arg_types import float_above, int_at_least, model_directory
from kvserve.experiments.report import format_table

BLOCK_SIZE = 16
NUM_BLOCKS = 4096
MAX_NUM_BATCHED_TOKENS = 2048
TARGET_RATIO = 0.7


def make_workload(num_requests: int, vocab_size: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompts of 16-128 random tokens, each asking for 64-128 new tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(16, 129))] for _ in range(num_requests)]
    return prompts, [rng.randrange(64, 129) for _ in prompts]


# -- the client (a child process) ----------------------------------------------------------


def _client_main(conn: Connection, prompts: list[list[int]], max_tokens: list[int]) -> None:
    """Child process: for each target received, open every stream at once and read them all.

    Answers (seconds, token ids of each stream, messages of each stream); ends when the pipe closes.
    """
    import grpc

    from kvserve.proto import generate_pb2, generate_pb2_grpc

    async def run(target: str) -> tuple[float, list[list[int]], list[int]]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)

            async def one(prompt: list[int], n: int) -> tuple[list[int], int]:
                request = generate_pb2.GenerateRequest(
                    token_ids=generate_pb2.TokenIds(ids=prompt),
                    sampling_params=generate_pb2.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                )
                token_ids: list[int] = []
                num_messages = 0
                async for message in stub.Generate(request):
                    token_ids += message.token_ids
                    num_messages += 1
                return token_ids, num_messages

            await one(prompts[0], 2)  # warm up the channel and the replica
            start = time.perf_counter()
            streams = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens)))
            elapsed = time.perf_counter() - start
            return elapsed, [t for t, _ in streams], [m for _, m in streams]

    while True:
        try:
            target = conn.recv()
        except EOFError:
            break
        conn.send(asyncio.run(run(target)))


@contextmanager
def client_process(prompts: list[list[int]], max_tokens: list[int]) -> Iterator[Connection]:
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    client = context.Process(target=_client_main, args=(child, prompts, max_tokens), daemon=True)
    client.start()
    child.close()
    try:
        yield parent
    finally:
        parent.close()
        client.join(timeout=30)
        if client.is_alive():  # it returns once the pipe closes; a stuck one must not outlive the run
            client.terminate()
            client.join()


# -- the engines -----------------------------------------------------------------------------


@contextmanager
def local_cluster(model_dir: Path, threads: int, async_scheduling: bool = False) -> Iterator[object]:
    """A local Ray instance with the cluster started on it; yields the ``ClusterHandle``."""
    import ray

    from kvserve.cluster.config import ClusterConfig
    from kvserve.cluster.launcher import init_local_ray, start_cluster

    init_local_ray(num_worker_slots=1)
    try:
        handle = start_cluster(
            ClusterConfig.from_kwargs(
                str(model_dir),
                block_size=BLOCK_SIZE,
                num_blocks=NUM_BLOCKS,
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                enable_prefix_caching=False,
                device="cpu",
                cpu_threads=threads,
                async_scheduling=async_scheduling,
            )
        )
        try:
            yield handle
        finally:
            handle.shutdown()
    finally:
        ray.shutdown()


class ServerLoop:
    """An event loop thread for the gRPC server, as ``kvserve serve`` runs it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()


class ProcessTreeCpuClock:
    """CPU seconds used so far by this process and its live descendants (Ray's, the client), from /proc.

    NaN where there is no /proc.  NOTE: every process of the tree, idle or not,
    in both engines' measurements: Ray's idle processes cost a few
    milliseconds per second.
    """

    def __init__(self) -> None:
        self._tick_s = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.0

    def seconds(self) -> float:
        if not Path("/proc/self/stat").exists():
            return float("nan")
        children: dict[int, list[int]] = {}
        ticks: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                text = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # exited meanwhile
                continue
            # The fields after the command name (which may hold spaces): state ppid ... utime stime.
            fields = text[text.rindex(")") + 2 :].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
            ticks[int(entry)] = int(fields[11]) + int(fields[12])
        total, pending = 0, [os.getpid()]
        while pending:
            pid = pending.pop()
            total += ticks.get(pid, 0)
            pending.extend(children.get(pid, ()))
        return total * self._tick_s


def time_cluster(
    handle, server_loop: ServerLoop, client: Connection, pacing: dict[str, object], num_requests: int
) -> tuple[float, list[list[int]], list[int]]:
    """One client run against a fresh server paced by ``pacing`` (``ServerConfig`` fields):
    (seconds, tokens, messages per stream)."""
    from kvserve.cluster.config import ServerConfig
    from kvserve.cluster.server import start_server

    config = ServerConfig(port=0, max_concurrent_requests=max(1024, num_requests + 1), **pacing)
    server = server_loop.run(start_server(handle.scheduler, handle.model_info, config))
    try:
        client.send(f"127.0.0.1:{server.port}")
        return client.recv()
    finally:
        server_loop.run(server.stop(grace_s=1.0))


def best_round(runs: list[tuple[float, float, list[int]]]) -> tuple[float, float, list[int]]:
    """The fastest of ``runs`` (seconds, CPU seconds, messages per stream), whole: its figures belong together."""
    return min(runs, key=lambda run: run[0])


def main(argv: list[str] | None = None) -> int:
    from kvserve.cluster.config import ServerConfig

    defaults = ServerConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=model_directory, help="model directory (default: a fresh tiny Llama)")
    parser.add_argument("--num-requests", type=int_at_least(1), default=256, help="concurrent requests (default: 256)")
    parser.add_argument("--threads", type=int_at_least(1), default=1,
                        help="torch threads of the model, in both runs (default: 1)")
    parser.add_argument("--repeat", type=int_at_least(1), default=3,
                        help="rounds; the best run of each engine counts (default: 3)")
    parser.add_argument(
        "--scheduling", choices=["plain", "overlapped", "both"], default="both",
        help="plain steps, overlapped (async) scheduling, or both in one run, each with a cluster of its own "
        "(default: both)",
    )
    parser.add_argument(
        "--stream-intervals", type=float_above(0), nargs="*", default=[], metavar="S",
        help="also measure fixed stream intervals of S > 0 seconds, without a message budget (default: none)",
    )
    args = parser.parse_args(argv)
    default_label = (
        f"default: {defaults.stream_interval_s * 1000:.0f} ms, "
        f"{defaults.max_messages_per_s} msg/s ({1000 * args.num_requests / defaults.max_messages_per_s:.0f} ms)"
        if defaults.max_messages_per_s else f"default: {defaults.stream_interval_s * 1000:.0f} ms"
    )
    variants: dict[str, dict[str, object]] = {
        "none: every fetch": {"stream_interval_s": 0.0, "max_messages_per_s": None},
        default_label: {},
    }
    for interval in args.stream_intervals:
        variants[f"{interval * 1000:.0f} ms, no budget"] = {"stream_interval_s": interval, "max_messages_per_s": None}
    import torch

    from kvserve import LLM, SamplingParams
    from kvserve.worker.model_config import ModelConfig
    from kvserve.worker.tiny_model import create_tiny_model

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or create_tiny_model(Path(tmp) / "tiny", "llama", seed=0)
        prompts, max_tokens = make_workload(args.num_requests, ModelConfig.from_pretrained(model_dir).vocab_size)
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
        schedulings = ["plain", "overlapped"] if args.scheduling == "both" else [args.scheduling]
        local_runs: dict[str, list[tuple[float, float]]] = {scheduling: [] for scheduling in schedulings}
        # (seconds, CPU seconds, messages per stream) of each round.
        cluster_runs: dict[tuple[str, str], list[tuple[float, float, list[int]]]] = {
            (scheduling, label): [] for scheduling in schedulings for label in variants
        }
        llm = LLM(
            model_dir,
            block_size=BLOCK_SIZE,
            num_blocks=NUM_BLOCKS,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            enable_prefix_caching=False,
        )
        with llm, client_process(prompts, max_tokens) as client:
            llm.generate(prompts[:2], params[:2])  # warm up
            cpu_clock = ProcessTreeCpuClock()
            # One cluster per scheduling (the setting is the cluster's); the in-process engine
            # schedules the same way in the rounds beside it.
            for scheduling in schedulings:
                overlapped = scheduling == "overlapped"
                llm.engine.async_scheduling = overlapped  # nothing is in flight between generate() calls
                print(f"{scheduling} scheduling: starting the cluster", flush=True)
                server_loop = ServerLoop()
                try:
                    with local_cluster(model_dir, args.threads, async_scheduling=overlapped) as handle:
                        for round_index in range(args.repeat):
                            print(f"  round {round_index + 1} of {args.repeat}", flush=True)
                            cpu_start, start = cpu_clock.seconds(), time.perf_counter()
                            outputs = llm.generate(prompts, params)
                            local_runs[scheduling].append((time.perf_counter() - start, cpu_clock.seconds() - cpu_start))
                            local_tokens = [output.token_ids for output in outputs]
                            for label, pacing in variants.items():
                                cpu_start = cpu_clock.seconds()
                                elapsed, tokens, num_messages = time_cluster(
                                    handle, server_loop, client, pacing, args.num_requests
                                )
                                cluster_runs[scheduling, label].append(
                                    (elapsed, cpu_clock.seconds() - cpu_start, num_messages)
                                )
                                if tokens != local_tokens:
                                    raise RuntimeError("the cluster generated other tokens than the in-process engine")
                finally:
                    server_loop.close()
    load_after = os.getloadavg()[0]

    num_generated = sum(max_tokens)
    rows = []
    best_rate: dict[tuple[str, str], float] = {}
    for scheduling in schedulings:
        local_s, local_cpu_s = min(local_runs[scheduling])
        local_rate = num_generated / local_s
        best_rate[scheduling, "in-process"] = local_rate
        rows.append([
            "in-process LLM", scheduling, "-", num_generated, f"{local_s:.2f}", f"{local_rate:.0f}", "1.00", "-",
            f"{local_cpu_s / num_generated * 1e6:.0f}",
        ])
        for label in variants:
            # The best round's time, and its messages: the figures of one round.
            seconds, cpu_s, per_stream = best_round(cluster_runs[scheduling, label])
            rate = num_generated / seconds
            best_rate[scheduling, label] = rate
            rows.append([
                "cluster over gRPC", scheduling, label, num_generated, f"{seconds:.2f}", f"{rate:.0f}",
                f"{rate / local_rate:.2f}", f"{sum(per_stream) / len(per_stream):.1f}",
                f"{cpu_s / num_generated * 1e6:.0f}",
            ])
    print(
        f"end-to-end generation: {args.num_requests} concurrent requests, 16-128 prompt tokens, "
        f"64-128 new tokens, greedy, 1 replica TP 1, float32 CPU, {args.threads} model thread(s), "
        f"best of {args.repeat} alternating rounds per scheduling; every cluster output identical to the "
        f"in-process engine's; "
        f"{os.cpu_count()} cores, load average {load_before:.1f} before, {load_after:.1f} after"
    )
    print(format_table(
        ["engine", "scheduling", "stream pacing", "generated tok", "seconds", "tok/s", "ratio",
         "messages per stream", "CPU us per token"],
        rows,
    ))
    if len(schedulings) == 2:
        print("overlapped / plain tok/s: " + ", ".join(
            f"{label} {best_rate['overlapped', label] / best_rate['plain', label]:.2f}"
            for label in ["in-process", *variants]
        ))
    print("(CPU: every process of the engine, all threads: for the cluster the front end and its client, the "
          "scheduler and the worker actors, Ray's own processes; in the best run)")
    print(target_line({
        scheduling: best_rate[scheduling, default_label] / best_rate[scheduling, "in-process"]
        for scheduling in schedulings
    }))
    return 0


def target_line(ratios: dict[str, float]) -> str:
    """Whether each scheduling's ratio with the server's default pacing met ``TARGET_RATIO``."""
    verdicts = ", ".join(
        f"{scheduling} {ratio:.2f} {'met' if ratio >= TARGET_RATIO else 'NOT met'}"
        for scheduling, ratio in ratios.items()
    )
    return (f"target: ratio >= {TARGET_RATIO} with the server's defaults (ratio: against the in-process engine "
            f"scheduling the same way): {verdicts}")


if __name__ == "__main__":
    raise SystemExit(main())
