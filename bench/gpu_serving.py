"""Serving speed on a GPU against the hardware's floors, transformers and the gRPC server.

    python -m kvserve.bench.gpu_serving --shape llama-3-8b     (or --shape llama-3.2-1b, --model DIR)

In one run, on one device:

0. ceilings: the read rate (a 4 GiB bf16 ``sum``) and the bf16 matmul rate (8192^3);
a. decode step time at batch 1/16/64/256 (prompts of ``--decode-context`` tokens), eager,
   through CUDA graphs, and through graphs with overlapped (async) scheduling, against the
   floor (weight bytes + K/V bytes read) / read rate; each step is ``engine.step()`` as
   ``LLM.generate`` runs it (schedule, execute, update); each row is printed as it is measured
   (``bench.decode_steps``);
b. prefill attention TFLOP/s against dense causal FlashAttention (``bench.prefill_attention``);
c. the end-to-end workloads of ``bench.serving_workloads`` through ``LLM.generate``, plain and
   with async scheduling, in output tokens/s, against the workload's floor and transformers'
   ``generate`` (static batches of
   ``--hf-batch`` left-padded prompts, the first ``--hf-prompts`` of each workload); then the plain
   runs' steps by kind (with prefill tokens, decode only), each against its own floor
   (``bench.step_roofline``);
d. the ``mixed`` workload through ``kvserve serve`` (a local Ray cluster) and gRPC, against (c), once
   (the server's prefix cache stays warm), on the port the started server says it listens on;
e. the ``mixed`` workload through the step protocol over gRPC on loopback, plain and with async
   scheduling, against in-process (the same run): ``EngineCore`` over ``GrpcReplicaExecutor`` here,
   a StepWorker server with a ``Worker`` in a child process (``bench.grpc_replica``).  That is the
   cluster replica's data path (scheduler, step codec, gRPC stream, worker) without Ray and without
   the client-facing front end: not ``kvserve serve`` (that is (d)), and it runs where Ray does not.
   Outputs must equal in-process's token for token.  A second table says where the worker's
   steps went, in process and over gRPC: the host's launch, the device's run and the device's
   idle time between steps (``bench.worker_timeline``, CUDA events).

Greedy, EOS ignored, bfloat16, random weights (timing depends on shapes, not values).
``--parts`` picks parts; ``--scale`` shrinks the workloads (a CPU smoke run); ``--repeat N`` shows
the median of N runs in (c) and (e) (default one run: scripts/gpu_check.sh's time limits).
A part this device cannot run is named and skipped; nothing left to run exits 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvserve.bench.arg_types import float_above, int_at_least, positive_ints
from kvserve.bench.decode_steps import (
    decode_max_tokens,
    decode_pool_blocks,
    decode_row_line,
    decode_steps,
    decode_table_head,
    kernel_breakdown,
)
from kvserve.bench.model_source import add_model_arguments, model_dir_for
from kvserve.bench.serving_workloads import Workload, make_workloads, model_cost, workload_floor_s
from kvserve.bench.step_roofline import ROOFLINE_HEADERS, StepTimes, roofline_rows
from kvserve.bench.worker_timeline import TIMELINE_HEADERS, TimedRunner, TimelineSummary, summarize
from kvserve.experiments.report import format_table

PARTS = "abcde"
# The engine's settings (its defaults) that part (a)'s pool size rests on.
BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 2048
# A CPU run's KV pool for parts (c)-(e), where preemption only slows a workload down; part (a)
# may need more (``decode_pool_blocks``).
CPU_WORKLOAD_BLOCKS = 4096


def ceilings() -> tuple[float, float]:
    """(read bytes/s, bf16 matmul FLOP/s) of this GPU."""
    from kvserve.bench.attention import memory_bandwidths_gbps, time_us_per_call

    _, read_gbps = memory_bandwidths_gbps(replays=10)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_us, _ = time_us_per_call([lambda: a @ b] * 4, replays=10, use_graph=False)
    return read_gbps * 1e9, 2 * 8192**3 / (mm_us * 1e-6)


def run_kvserve(llm, workload: Workload, async_scheduling: bool = False,
                repeat: int = 1) -> tuple[float, list[list[int]]]:
    """The median seconds of ``repeat`` runs of ``workload`` through ``llm.generate``, and the first
    run's output tokens of every request."""
    return _timed_run(llm.engine, lambda prompts, params: [o.token_ids for o in llm.generate(prompts, params)],
                      workload, async_scheduling, repeat)


def _timed_run(engine, generate, workload: Workload, async_scheduling: bool,
               repeat: int = 1) -> tuple[float, list[list[int]]]:
    """The median seconds of ``repeat`` runs of ``generate(prompts, params)`` of ``workload`` on
    ``engine``, greedy, each from a cold prefix cache; and the first run's outputs."""
    from kvserve import SamplingParams

    engine.async_scheduling = async_scheduling  # nothing is in flight between runs
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.max_tokens]
    seconds, outputs = [], []
    for _ in range(repeat):
        # Every run starts from a cold prefix cache: the runs share their prompts.
        if not engine.scheduler.kv_cache_manager.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset: blocks are still in use")
        start = time.perf_counter()
        token_ids = generate(workload.prompts, params)
        seconds.append(time.perf_counter() - start)
        if [len(t) for t in token_ids] != workload.max_tokens:
            raise RuntimeError(f"{workload.name}: kvserve generated a different number of tokens than asked")
        outputs = outputs or token_ids
    return statistics.median(seconds), outputs


def run_step_protocol(llm_config, model_config, num_kv_blocks: int, workload: Workload,
                      in_process: dict[bool, tuple[float, list[list[int]]]], repeat: int = 1,
                      ) -> tuple[list[list[str]], list[list[str]]]:
    """Rows of part (e): ``workload`` through a replica over the step protocol (``bench.grpc_replica``),
    plain and with async scheduling (one step ahead, and the cluster's ``STEPS_AHEAD``), the median of
    ``repeat`` runs each, against ``in_process[async_scheduling]`` = (seconds, outputs); and the
    worker's timeline rows of those runs (``bench.worker_timeline``).

    The worker has the in-process replica's settings and block count, so the scheduler makes the
    same plans; ``RuntimeError`` unless every output equals in-process's token for token.
    """
    import dataclasses
    import functools

    from kvserve.bench.grpc_replica import StepProtocolReplica, worker_server
    from kvserve.bench.worker_timeline import read_records, timed_worker
    from kvserve.cluster.replica_client import STEPS_AHEAD
    from kvserve.worker.worker_config import WorkerConfig

    worker_config = dataclasses.replace(WorkerConfig.for_engine(llm_config, model_config.max_model_len),
                                        num_blocks=num_kv_blocks)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the child sizes nothing from free memory, but needs room for the same cache
    over_grpc, windows = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        records_path = str(Path(scratch) / "worker_timeline.json")
        with worker_server(worker_config, runner=functools.partial(timed_worker, records_path)) as (address, secret):
            replica = StepProtocolReplica(address, secret, llm_config, model_config)
            try:
                for async_scheduling, steps_ahead in ((False, 1), (True, 1), (True, STEPS_AHEAD)):
                    replica.engine.steps_ahead = steps_ahead  # nothing is in flight between runs
                    _timed_run(replica.engine, replica.generate, warm_up(workload), async_scheduling)
                    since = time.time()  # the worker's steps of these runs: launched from now on
                    over_grpc[async_scheduling, steps_ahead] = _timed_run(
                        replica.engine, replica.generate, workload, async_scheduling, repeat)
                    windows[async_scheduling, steps_ahead] = (since, time.time())
            finally:
                replica.close()  # the worker writes its records as it shuts down
        records = read_records(records_path)
    timeline = []
    for (async_scheduling, steps_ahead), (since, until) in windows.items():
        name = f"async sched., {steps_ahead} ahead" if async_scheduling else "plain"
        timeline.append(summarize(records, since, until).row(f"step protocol, {name}"))
    rows = []
    tokens = workload.num_output_tokens
    for async_scheduling, name in ((False, "plain"), (True, "async sched.")):
        local_s, local_ids = in_process[async_scheduling]
        rows.append([f"in-process, {name}", f"{local_s:.2f}", f"{tokens / local_s:.0f}", "1.00", "-"])
        for (grpc_async, steps_ahead), (grpc_s, grpc_ids) in over_grpc.items():
            if grpc_async != async_scheduling:
                continue
            ahead = f", {steps_ahead} ahead" if async_scheduling else ""
            check_same_outputs(local_ids, grpc_ids, f"{workload.name}, {name}{ahead}")
            rows.append([f"step protocol, {name}{ahead}", f"{grpc_s:.2f}", f"{tokens / grpc_s:.0f}",
                         f"{local_s / grpc_s:.2f}", "equal"])
    return rows, timeline


def warm_up(workload: Workload) -> Workload:
    """Eight new tokens for each of ``workload``'s first eight prompts."""
    prompts = workload.prompts[:8]
    return Workload("warm-up", prompts, [8] * len(prompts), [0] * len(prompts))


def check_same_outputs(expected: list[list[int]], actual: list[list[int]], what: str) -> None:
    """``RuntimeError`` naming the first request whose tokens differ from ``expected``'s."""
    if len(actual) != len(expected):
        raise RuntimeError(f"{what}: {len(actual)} outputs, expected {len(expected)}")
    for i, (want, got) in enumerate(zip(expected, actual)):
        if list(got) != list(want):
            at = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            raise RuntimeError(f"{what}: request {i}'s output differs from in-process's at token {at} "
                               f"(in-process {list(want)[at:at + 4]}, step protocol {list(got)[at:at + 4]})")


def run_transformers(model_dir: Path, workloads: list[Workload], count: int, batch: int, device: str) -> dict[str, float]:
    """Output tokens/s of transformers' ``generate`` on the first ``count`` prompts of each workload."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    rates = {}
    for workload in workloads:
        prompts, max_new = workload.prompts[:count], workload.max_tokens[:count]
        tokens, start = 0, time.perf_counter()
        for i in range(0, len(prompts), batch):
            part, new = prompts[i : i + batch], max(max_new[i : i + batch])
            width = max(len(p) for p in part)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in part], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in part], device=device)
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               pad_token_id=0)
            tokens += sum(max_new[i : i + batch])
        if device == "cuda":
            torch.cuda.synchronize()
        rates[workload.name] = tokens / (time.perf_counter() - start)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return rates


def run_grpc(model_dir: Path, workload: Workload, port: int, device: str, timeout_s: float) -> float:
    """Seconds for ``workload`` through a ``kvserve serve`` subprocess, all streams at once.

    ``port`` 0: a free one the server picks.  The port timed is the one the started server says it
    listens on (its own start-up line), so a server left on a fixed port is never measured: it
    holds the port, and the new one fails to start (``RuntimeError`` with its output).
    """
    import asyncio

    import grpc

    from kvserve.bench.serve_process import ServeProcess
    from kvserve.proto import generate_pb2, generate_pb2_grpc

    async def one(stub, prompt: list[int], n: int) -> int:
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt),
            sampling_params=generate_pb2.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
        )
        return sum([len(message.token_ids) async for message in stub.Generate(request)])

    async def run(address: str) -> float:
        async with grpc.aio.insecure_channel(address) as channel:
            await asyncio.wait_for(channel.channel_ready(), timeout_s)
            stub = generate_pb2_grpc.GenerationStub(channel)
            deadline = time.monotonic() + timeout_s
            while True:  # a short request first, retried while the replica comes up
                try:
                    await one(stub, workload.prompts[0][:8], 2)
                    break
                except grpc.aio.AioRpcError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(1.0)
            start = time.perf_counter()
            counts = await asyncio.gather(*(one(stub, p, n) for p, n in zip(workload.prompts, workload.max_tokens)))
            elapsed = time.perf_counter() - start
            if list(counts) != workload.max_tokens:
                raise RuntimeError("the server streamed a different number of tokens than asked")
            return elapsed

    args = ["--model", str(model_dir), "--device", device, "--host", "127.0.0.1", "--port", str(port), "--no-http",
            "--max-concurrent-requests", "4096"]
    if device != "cuda":
        args += ["--num-blocks", str(CPU_WORKLOAD_BLOCKS)]
    with ServeProcess(args) as server:
        listening = server.wait_for_port(timeout_s)
        if port and listening != port:
            raise RuntimeError(f"kvserve serve was asked for port {port} and listens on {listening}")
        return asyncio.run(run(f"127.0.0.1:{listening}"))


def port_in_use(port: int) -> bool:
    """Whether a socket on 127.0.0.1 already holds ``port``."""
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def part_letters(text: str) -> str:
    """An argparse ``type``: some of the parts ``abcde``, e.g. ``ac``, else a usage error."""
    if not text or not set(text) <= set(PARTS):
        raise argparse.ArgumentTypeError(f"expected some of the letters {PARTS}, e.g. 'ac', got {text!r}")
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--parts", type=part_letters, default=PARTS, help=f"which parts to run (default {PARTS})")
    parser.add_argument("--batches", type=positive_ints, default=(1, 16, 64, 256),
                        help="decode batch sizes (default 1,16,64,256)")
    parser.add_argument("--decode-context", type=int_at_least(1), default=1024,
                        help="prompt tokens of each decode request (default 1024)")
    parser.add_argument("--decode-steps", type=int_at_least(1), default=20,
                        help="timed steps per batch and mode (default 20)")
    parser.add_argument("--profile-batch", type=int_at_least(0), default=64,
                        help="after (a), the kernels of a decode step at this batch, on a GPU (default 64; 0: off)")
    parser.add_argument("--scale", type=float_above(0), default=1.0,
                        help="scale the workloads' counts and lengths by this (default 1.0)")
    parser.add_argument("--repeat", type=int_at_least(1), default=1, metavar="N",
                        help="runs of each configuration in (c) and (e), whose median is shown (default 1: "
                             "scripts/gpu_check.sh's time limits allow one)")
    parser.add_argument("--hf-prompts", type=int_at_least(1), default=64,
                        help="prompts per workload for transformers (default 64)")
    parser.add_argument("--hf-batch", type=int_at_least(1), default=64, help="transformers' batch size (default 64)")
    parser.add_argument("--grpc-port", type=int_at_least(0), default=0,
                        help="port of part (d)'s server (default 0: a free one, chosen when it starts)")
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the workloads and weights (default 0)")
    args = parser.parse_args(argv)
    if args.grpc_port > 65535:
        parser.error(f"--grpc-port {args.grpc_port}: a port is at most 65535")
    if "d" in args.parts and args.grpc_port and port_in_use(args.grpc_port):
        parser.error(f"--grpc-port {args.grpc_port}: in use (by a server left running?); give another, or 0")
    return args


def runs(repeat: int) -> str:
    return "one run" if repeat == 1 else f"the median of {repeat} runs"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        print(f"--device cuda: no CUDA device is visible (torch {torch.__version__})", file=sys.stderr)
        return 1
    parts = args.parts
    if not on_gpu and "b" in parts:
        print("part (b), prefill attention, needs a CUDA device: skipped", file=sys.stderr)
        parts = parts.replace("b", "")
    if "d" in parts and importlib.util.find_spec("ray") is None:
        print("part (d), kvserve serve, needs Ray, which is not installed: skipped", file=sys.stderr)
        parts = parts.replace("d", "")
    if not parts:
        print(f"nothing of --parts {args.parts} can run here", file=sys.stderr)
        return 1
    read_rate = matmul_rate = None
    if on_gpu:
        read_rate, matmul_rate = ceilings()
        print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}: read {read_rate / 1e12:.2f} TB/s, "
              f"bf16 matmul {matmul_rate / 1e12:.0f} TFLOP/s", flush=True)
    if "b" in parts:
        from kvserve.bench.prefill_attention import CASES, prefill_table, run_case

        print("\n(b) prefill attention, 32/8 heads x 128, bf16\n")
        print(prefill_table([run_case(cached, new) for cached, new in CASES]), flush=True)
    if not set(parts) & set("acde"):
        return 0

    from kvserve import LLM
    from kvserve.worker.model_config import ModelConfig

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = model_dir_for(args, Path(scratch), num_hidden_layers=2)
        config = ModelConfig.from_pretrained(model_dir)
        longest = args.decode_context + decode_max_tokens(max(args.batches), args.decode_context, args.decode_steps,
                                                          MAX_NUM_BATCHED_TOKENS) + 1
        if "a" in parts and longest > config.max_model_len:
            print(f"--decode-context {args.decode_context}: its requests reach {longest} tokens and the model serves "
                  f"at most {config.max_model_len}", file=sys.stderr)
            return 2
        from transformers import AutoConfig

        cost = model_cost(AutoConfig.from_pretrained(model_dir), dtype_bytes=2 if on_gpu else 4)
        workloads = make_workloads(config.vocab_size, args.scale, args.seed)
        if any(part in parts for part in "cde"):  # the end-to-end parts serve the workloads
            reach, name = max((len(p) + n, w.name) for w in workloads for p, n in zip(w.prompts, w.max_tokens))
            if reach > config.max_model_len:
                print(f"--scale {args.scale:g}: the {name} workload's requests reach {reach} tokens and the model "
                      f"serves at most {config.max_model_len}", file=sys.stderr)
                return 2
        mixed = workloads[0]
        kvserve_s: dict[str, float] = {}
        overlapped_s: dict[str, float] = {}
        in_process: dict[bool, tuple[float, list[list[int]]]] = {}  # mixed's, for (e)
        in_process_timeline: dict[bool, TimelineSummary] = {}  # where its worker's steps went
        roofline: list[list[str]] = []  # the plain runs' steps by kind (bench.step_roofline)
        num_blocks = None  # on a GPU: from free memory
        if not on_gpu:  # the workloads' pool, or one that holds part (a)'s largest batch to its last token
            decode_blocks = decode_pool_blocks(args.batches, args.decode_context, args.decode_steps,
                                               MAX_NUM_BATCHED_TOKENS, BLOCK_SIZE) if "a" in parts else 0
            num_blocks = max(CPU_WORKLOAD_BLOCKS, decode_blocks)
        start = time.perf_counter()
        llm = LLM(model_dir, device=device, max_num_seqs=max(256, args.profile_batch, *args.batches),
                  block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, num_blocks=num_blocks)
        replica_settings = (llm.config, llm.model_config, llm.engine.executor.num_kv_blocks)
        print(f"\nLLM started in {time.perf_counter() - start:.1f} s", flush=True)
        try:
            if "a" in parts:
                print(f"\n(a) decode step, {args.decode_context}-token prompts, median of {args.decode_steps} steps\n")
                print(decode_table_head(), flush=True)
                for row in decode_steps(llm, args.batches, args.decode_context, config.vocab_size, args.decode_steps,
                                        cost, read_rate):
                    print(decode_row_line(row), flush=True)
                if on_gpu and args.profile_batch:
                    print(kernel_breakdown(llm, args.profile_batch, args.decode_context, config.vocab_size), flush=True)
            end_to_end = workloads if "c" in parts else [mixed] if "e" in parts else []
            if end_to_end:
                run_kvserve(llm, warm_up(mixed))
            for workload in end_to_end:
                executor = llm.engine.executor
                timed = TimedRunner(executor.worker) if workload is mixed and hasattr(executor, "worker") else None
                if timed is not None:
                    executor.worker = timed
                began = time.time()  # the plain runs' steps are launched from now on, then the async runs'
                with StepTimes().recording(llm.engine) as times:
                    plain = run_kvserve(llm, workload, repeat=args.repeat)
                between = time.time()
                roofline += roofline_rows(workload.name, times.steps, args.repeat, plain[0], cost, matmul_rate,
                                          read_rate)
                overlapped = run_kvserve(llm, workload, async_scheduling=True, repeat=args.repeat)
                if timed is not None:
                    executor.worker = timed.runner
                    records = timed.records()
                    in_process_timeline = {False: summarize(records, began, between),
                                           True: summarize(records, between, time.time())}
                kvserve_s[workload.name], overlapped_s[workload.name] = plain[0], overlapped[0]
                if workload is mixed:
                    in_process = {False: plain, True: overlapped}
                print(f"  {workload.name}: {plain[0]:.2f} s, with async scheduling {overlapped[0]:.2f} s "
                      f"({runs(args.repeat)} each)", flush=True)
        finally:
            llm.shutdown()
            del llm
        if "c" in parts:
            hf = run_transformers(model_dir, workloads, args.hf_prompts, args.hf_batch, device)
            rows = []
            for w in workloads:
                plain_s, async_s = kvserve_s[w.name], overlapped_s[w.name]
                floor_s = workload_floor_s(w, cost, matmul_rate, read_rate) if on_gpu else None
                rows.append([w.name, len(w.prompts), w.num_output_tokens, f"{plain_s:.2f}", f"{async_s:.2f}",
                             f"{w.num_output_tokens / plain_s:.0f}", f"{w.num_output_tokens / async_s:.0f}",
                             f"{hf[w.name]:.0f}", f"{w.num_output_tokens / min(plain_s, async_s) / hf[w.name]:.1f}",
                             f"{floor_s:.2f}" if floor_s else "-",
                             f"{min(plain_s, async_s) / floor_s:.2f}" if floor_s else "-"])
            print(f"\n(c) end to end, each run from a cold prefix cache; kvserve: {runs(args.repeat)} per figure "
                  f"(--repeat), transformers: one run of the first {args.hf_prompts} prompts, batches of "
                  f"{args.hf_batch}\n")
            print(format_table(["workload", "requests", "output tokens", "kvserve s", "async sched. s", "kvserve tok/s",
                                "async tok/s", "transformers tok/s", "best vs transformers", "floor s",
                                "best / floor"], rows), flush=True)
            print("\nwhere the plain runs' time went: each step against its own floor (the larger of its FLOPs at "
                  "the matmul rate and its bytes at the read rate); 'share of run' left over is the host between "
                  "steps\n")
            print(format_table(ROOFLINE_HEADERS, roofline), flush=True)
        if "d" in parts:
            grpc_s = run_grpc(model_dir, mixed, args.grpc_port, device, timeout_s=300)
            local = kvserve_s.get(mixed.name)
            print(f"\n(d) the mixed workload through kvserve serve --device {device} and gRPC: one run (the server's "
                  f"prefix cache is not reset between runs); in-process: {runs(args.repeat)}\n")
            print(format_table(
                ["path", "s", "tok/s", "vs in-process"],
                [["gRPC", f"{grpc_s:.2f}", f"{mixed.num_output_tokens / grpc_s:.0f}",
                  f"{local / grpc_s:.2f}" if local else "-"]]
                + ([["in-process", f"{local:.2f}", f"{mixed.num_output_tokens / local:.0f}", "1.00"]] if local else []),
            ), flush=True)
        if "e" in parts:
            rows, timeline = run_step_protocol(*replica_settings, mixed, in_process, args.repeat)
            print(f"\n(e) the mixed workload through the step protocol over gRPC on loopback, --device {device}: "
                  f"EngineCore + GrpcReplicaExecutor here, a StepWorker server and Worker in a child process; "
                  f"no Ray, no front end, not kvserve serve (that is (d)); greedy; {runs(args.repeat)} per figure\n")
            print(format_table(["path", "s", "tok/s", "vs in-process (same scheduling)", "outputs vs in-process"],
                               rows), flush=True)
            timeline = [in_process_timeline[a].row(f"in-process, {name}") for a, name in
                        ((False, "plain"), (True, "async sched.")) if a in in_process_timeline] + timeline
            print("\nwhere the worker's steps went (steps with rows; device times by CUDA events, '-' without "
                  "CUDA): 'device idle' is the device waiting for the host's next launch\n")
            print(format_table(TIMELINE_HEADERS, timeline), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
