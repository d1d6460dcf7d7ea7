"""End-to-end throughput: the cluster over gRPC against the in-process engine.

The same prompts, the same settings (one replica, TP 1, greedy, EOS
ignored, float32 CPU, the same torch threads for the model; prefix caching off,
so that repeated runs cost the same), in one run:

* in process: ``kvserve.LLM(...).generate(all prompts)``;
* cluster: a local Ray instance on 127.0.0.1, ``start_cluster`` (scheduler
  actor + one worker actor), the gRPC server in this process, and a client in
  a child process that opens every ``Generate`` stream at once and reads them
  to the end.  The clock runs from the first request sent to the last message
  received.  The cluster is measured once per server ``stream_interval_s``
  (0: one message per step; larger: the tokens of several steps per message).

Every figure is the best of ``--repeat`` runs; the run fails if any stream's
tokens differ from the in-process engine's.  Figures: generated tokens per
second of each, and their ratio (target >= 0.7).

    python -m kvserve.bench.e2e_throughput [--model DIR] [--num-requests N] [--threads T]
                                           [--stream-intervals S ...] [--repeat R]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import random
import tempfile
import threading
import time
from pathlib import Path

from kvserve.bench.report import format_table

BLOCK_SIZE = 16
NUM_BLOCKS = 4096
MAX_NUM_BATCHED_TOKENS = 2048


def make_workload(num_requests: int, vocab_size: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompts of 16-128 random tokens, each asking for 64-128 new tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(16, 129))] for _ in range(num_requests)]
    return prompts, [rng.randrange(64, 129) for _ in prompts]


def run_in_process(
    model_dir: Path, prompts: list[list[int]], max_tokens: list[int], threads: int, repeat: int
) -> tuple[float, list[list[int]]]:
    """The best of ``repeat`` runs: seconds, and the tokens of each request."""
    import torch

    from kvserve import LLM, SamplingParams

    torch.set_num_threads(threads)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    times = []
    llm = LLM(
        model_dir,
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        enable_prefix_caching=False,
    )
    with llm:
        llm.generate(prompts[:2], params[:2])  # warm up
        for _ in range(repeat):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            times.append(time.perf_counter() - start)
    return min(times), [output.token_ids for output in outputs]


def _client_main(target: str, prompts: list[list[int]], max_tokens: list[int], repeat: int, conn) -> None:
    """Child process: open every stream at once, ``repeat`` times; send back (best seconds, token ids)."""
    import grpc

    from kvserve.proto import generate_pb2, generate_pb2_grpc

    async def run() -> tuple[float, list[list[int]]]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)

            async def one(prompt: list[int], n: int) -> list[int]:
                request = generate_pb2.GenerateRequest(
                    token_ids=generate_pb2.TokenIds(ids=prompt),
                    sampling_params=generate_pb2.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                )
                return [t async for message in stub.Generate(request) for t in message.token_ids]

            await one(prompts[0], 2)  # warm up the channel and the replica
            times = []
            for _ in range(repeat):
                start = time.perf_counter()
                token_ids = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens)))
                times.append(time.perf_counter() - start)
            return min(times), token_ids

    conn.send(asyncio.run(run()))
    conn.close()


def run_cluster(
    model_dir: Path,
    prompts: list[list[int]],
    max_tokens: list[int],
    threads: int,
    stream_intervals: list[float],
    repeat: int,
) -> list[tuple[float, float, list[list[int]]]]:
    """One cluster; one server after the other for each stream interval. (interval, seconds, tokens) each."""
    import ray

    from kvserve.cluster.config import ClusterConfig, ServerConfig
    from kvserve.cluster.launcher import start_cluster
    from kvserve.cluster.ray_loopback import keep_ray_on_loopback
    from kvserve.cluster.server import start_server
    from kvserve.cluster.worker_actor import RAY_NAMESPACE, WORKER_CPU_RESOURCE

    keep_ray_on_loopback()
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        namespace=RAY_NAMESPACE,
        resources={WORKER_CPU_RESOURCE: 1},
        logging_level=logging.WARNING,
    )
    handle = start_cluster(
        ClusterConfig(
            model_dir=str(model_dir),
            block_size=BLOCK_SIZE,
            num_blocks=NUM_BLOCKS,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            enable_prefix_caching=False,
            device="cpu",
            cpu_threads=threads,
        )
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    results = []
    try:
        for interval in stream_intervals:
            config = ServerConfig(
                port=0, max_concurrent_requests=max(1024, len(prompts) + 1), stream_interval_s=interval
            )
            server = asyncio.run_coroutine_threadsafe(
                start_server(handle.scheduler, handle.model_info, config), loop
            ).result()
            try:
                elapsed, token_ids = _run_client(f"127.0.0.1:{server.port}", prompts, max_tokens, repeat)
            finally:
                asyncio.run_coroutine_threadsafe(server.stop(grace_s=1.0), loop).result()
            results.append((interval, elapsed, token_ids))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        handle.shutdown()
        ray.shutdown()
    return results


def _run_client(
    target: str, prompts: list[list[int]], max_tokens: list[int], repeat: int
) -> tuple[float, list[list[int]]]:
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    client = context.Process(target=_client_main, args=(target, prompts, max_tokens, repeat, child))
    client.start()
    try:
        return parent.recv()
    finally:
        client.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="model directory (default: a fresh tiny Llama)")
    parser.add_argument("--num-requests", type=int, default=256, help="concurrent requests (default: 256)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the model, in both runs (default: 1)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each measurement; the best counts (default: 3)")
    parser.add_argument(
        "--stream-intervals", type=float, nargs="+", default=[0.0, 0.05, 0.1], metavar="S",
        help="the server's stream_interval_s values to measure: tokens of S seconds travel in one message "
        "(default: 0 0.05 0.1)",
    )
    args = parser.parse_args(argv)
    from kvserve.worker.model_config import ModelConfig
    from kvserve.worker.tiny_model import create_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or create_tiny_model(Path(tmp) / "tiny", "llama", seed=0)
        prompts, max_tokens = make_workload(args.num_requests, ModelConfig.from_pretrained(model_dir).vocab_size)
        local_s, local_tokens = run_in_process(model_dir, prompts, max_tokens, args.threads, args.repeat)
        cluster_runs = run_cluster(
            model_dir, prompts, max_tokens, args.threads, args.stream_intervals, args.repeat
        )
    num_generated = sum(max_tokens)
    local_rate = num_generated / local_s
    rows = [["in-process LLM", "-", num_generated, f"{local_s:.2f}", f"{local_rate:.0f}", "1.00"]]
    for interval, cluster_s, cluster_tokens in cluster_runs:
        if cluster_tokens != local_tokens:
            raise RuntimeError("the cluster generated other tokens than the in-process engine")
        cluster_rate = num_generated / cluster_s
        rows.append([
            "cluster over gRPC", f"{interval * 1000:.0f} ms", num_generated, f"{cluster_s:.2f}",
            f"{cluster_rate:.0f}", f"{cluster_rate / local_rate:.2f}",
        ])
    print(
        f"end-to-end generation: {args.num_requests} concurrent requests, 16-128 prompt tokens, "
        f"64-128 new tokens, greedy, 1 replica TP 1, float32 CPU, {args.threads} model thread(s), "
        f"best of {args.repeat}; cluster outputs identical to the in-process engine's"
    )
    print(format_table(["engine", "stream interval", "generated tok", "seconds", "tok/s", "ratio"], rows))
    print("target: ratio >= 0.7")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
