"""Serving speed on a GPU against the hardware's floors, transformers and the gRPC server.

    python -m kvserve.bench.gpu_serving --shape llama-3-8b     (or --shape llama-3.2-1b, --model DIR)

In one run, on one device:

0. ceilings: the read rate (a 4 GiB bf16 ``sum``) and the bf16 matmul rate (8192^3);
a. decode step time at batch 1/16/64/256 (prompts of ``--decode-context`` tokens), eager,
   through CUDA graphs, and through graphs with overlapped (async) scheduling, against the
   floor (weight bytes + K/V bytes read) / read rate; each step is ``engine.step()`` as
   ``LLM.generate`` runs it (schedule, execute, update);
b. prefill attention TFLOP/s against dense causal FlashAttention (``bench.prefill_attention``);
c. the end-to-end workloads of ``bench.serving_workloads`` through ``LLM.generate``, plain and
   with async scheduling, in output tokens/s, against the workload's floor and transformers'
   ``generate`` (static batches of
   ``--hf-batch`` left-padded prompts, the first ``--hf-prompts`` of each workload);
d. the ``mixed`` workload through ``kvserve serve`` (a local Ray cluster) and gRPC, against (c);
e. the ``mixed`` workload through the step protocol over gRPC on loopback, plain and with async
   scheduling, against in-process (the same run): ``EngineCore`` over ``GrpcReplicaExecutor`` here,
   a StepWorker server with a ``Worker`` in a child process (``bench.grpc_replica``).  That is the
   cluster replica's data path (scheduler, step codec, gRPC stream, worker) without Ray and without
   the client-facing front end: not ``kvserve serve`` (that is (d)), and it runs where Ray does not.
   Outputs must equal in-process's token for token.

Greedy, EOS ignored, bfloat16, random weights (timing depends on shapes, not values).
``--parts`` picks parts; ``--scale`` shrinks the workloads (a CPU smoke run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from kvserve.bench.model_source import add_model_arguments, model_dir_for
from kvserve.experiments.report import format_table
from kvserve.bench.serving_workloads import Workload, make_workloads, model_cost, workload_floor_s


def ceilings() -> tuple[float, float]:
    """(read bytes/s, bf16 matmul FLOP/s) of this GPU."""
    from kvserve.bench.attention import memory_bandwidths_gbps, time_us_per_call

    _, read_gbps = memory_bandwidths_gbps(replays=10)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_us, _ = time_us_per_call([lambda: a @ b] * 4, replays=10, use_graph=False)
    return read_gbps * 1e9, 2 * 8192**3 / (mm_us * 1e-6)


def decode_steps(llm, batches: list[int], context: int, vocab: int, steps: int, cost, read_rate: float | None):
    """Rows of part (a): per batch, the median eager and graphed step time and its floor."""
    engine, worker = llm.engine, llm.engine.executor.worker
    graphs = worker.decode_graphs
    rows = []
    for batch in batches:
        req_ids = _start_decoding(engine, batch, context, vocab, steps, f"decode-{batch}", seed=batch)
        tokens_before = sum(r.num_tokens for r in engine.scheduler.running)
        times = {}
        for mode in ("eager", "graphed", "overlapped"):
            if mode != "eager" and graphs is None:
                continue
            worker.decode_graphs = None if mode == "eager" else graphs
            engine.async_scheduling = mode == "overlapped"
            for _ in range(2):
                engine.step()
            samples = []
            for _ in range(steps):
                start = time.perf_counter()
                engine.step()
                samples.append(time.perf_counter() - start)
            times[mode] = statistics.median(samples) * 1e3
        worker.decode_graphs = graphs
        running = engine.scheduler.running
        if len(running) != batch:
            raise RuntimeError(f"{batch - len(running)} of {batch} requests ended while their steps were timed")
        tokens_after = sum(r.num_tokens for r in running)
        _abort_all(engine, req_ids)
        engine.async_scheduling = False
        floor_ms = None
        if read_rate is not None:  # K/V read by a step: the mean of the tokens held while timed
            kv_bytes = (tokens_before + tokens_after) / 2 * cost.kv_bytes_per_token
            floor_ms = (cost.weight_bytes + kv_bytes) / read_rate * 1e3
        best = min(times.values())
        rows.append([batch, f"{times['eager']:.2f}", *(f"{times[m]:.2f}" if m in times else "-" for m in ("graphed", "overlapped")),
                     f"{floor_ms:.2f}" if floor_ms else "-", f"{best / floor_ms:.2f}" if floor_ms else "-"])
    return rows


def _start_decoding(engine, batch: int, context: int, vocab: int, steps: int, tag: str, seed: int) -> list[str]:
    """``batch`` requests of ``context`` random tokens (none shared with another ``seed``'s),
    stepped until every one is decoding."""
    from kvserve import SamplingParams
    from kvserve.scheduler.request import Request

    generator = torch.Generator().manual_seed(seed)
    req_ids = []
    # Enough tokens that no request ends while its batch is timed: the first prompts start
    # decoding while the last ones are still prefilled.
    budget = engine.scheduler.scheduler_config.max_num_batched_tokens
    max_tokens = 4 * steps + 8 + -(-batch * context // budget)
    for i in range(batch):
        prompt = torch.randint(3, vocab, (context,), generator=generator).tolist()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = Request(f"{tag}-{i}", prompt, params)
        engine.add_request(request)
        req_ids.append(request.req_id)
    started: set[str] = set()
    while len(started) < batch:
        started.update(output.req_id for output in engine.step())
    return req_ids


def _abort_all(engine, req_ids: list[str]) -> None:
    engine.abort_requests(req_ids)
    while engine.has_unfinished_requests():  # with async scheduling on: the step in flight too
        engine.step()


def host_breakdown(engine, worker, steps: int) -> list[str]:
    """Per step, the host's microseconds in planning, launching, waiting for the samples and
    updating, and whether any launch synchronised with the device (torch's sync debug mode)."""
    from kvserve.worker.worker import LaunchedStep

    spent = {"plan": 0.0, "launch": 0.0, "wait": 0.0, "update": 0.0}
    syncs = []

    def timed(name, function):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
        return call

    launch = worker.launch

    def launch_checked(plan):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                return launch(plan)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            syncs.extend(str(w.message).splitlines()[0][:100] for w in caught if "synchroniz" in str(w.message))

    result = LaunchedStep.result
    engine.begin_step, engine.finish_step = timed("plan", engine.begin_step), timed("update", engine.finish_step)
    worker.launch = timed("launch", launch_checked)
    LaunchedStep.result = timed("wait", result)
    try:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    finally:
        del engine.begin_step, engine.finish_step, worker.launch
        LaunchedStep.result = result
    parts = ", ".join(f"{name} {seconds / steps * 1e6:.0f}" for name, seconds in spent.items())
    return [f"host us per step: {parts}; step {wall / steps * 1e6:.0f}",
            f"synchronising calls in launches: {len(syncs)} in {steps} steps" + (f" ({syncs[0]})" if syncs else "")]


def kernel_breakdown(llm, batch: int, context: int, vocab: int, steps: int = 5, top: int = 12) -> str:
    """Where a decode step's time goes at ``batch``: the host's parts, and the ``top`` kernels
    by device time per step (eager and graphed, through torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    engine, worker = llm.engine, llm.engine.executor.worker
    graphs = worker.decode_graphs
    req_ids = _start_decoding(engine, batch, context, vocab, 2 * steps + 4, "profile", seed=100_003)
    lines = []
    for mode in ("eager", "graphed", "overlapped"):
        if mode != "eager" and graphs is None:
            continue
        worker.decode_graphs = None if mode == "eager" else graphs
        engine.async_scheduling = mode == "overlapped"
        engine.step()
        lines.append(f"\n{mode}, batch {batch}: " + "; ".join(host_breakdown(engine, worker, steps)))
        if mode == "overlapped":
            continue
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
            wall_us = (time.perf_counter() - start) / steps * 1e6
        kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        device_us = lambda e: getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)  # noqa: E731
        kernels.sort(key=device_us, reverse=True)
        total = sum(device_us(e) for e in kernels) / steps
        launches = sum(e.count for e in kernels) / steps
        rows = [[e.key[:70], f"{e.count / steps:.0f}", f"{device_us(e) / steps:.0f}",
                 f"{device_us(e) / steps / total:.1%}" if total else "-"] for e in kernels[:top]]
        lines.append(f"profiled: step {wall_us:.0f} us wall, {total:.0f} us of kernels in {launches:.0f} launches\n")
        lines.append(format_table(["kernel", "per step", "us / step", "share"], rows))
    worker.decode_graphs = graphs
    _abort_all(engine, req_ids)
    engine.async_scheduling = False
    return "\n".join(lines)


def run_kvserve(llm, workload: Workload, async_scheduling: bool = False) -> tuple[float, list[list[int]]]:
    """Seconds for ``workload`` through ``llm.generate``, and every request's output tokens."""
    return _timed_run(llm.engine, lambda prompts, params: [o.token_ids for o in llm.generate(prompts, params)],
                      workload, async_scheduling)


def _timed_run(engine, generate, workload: Workload, async_scheduling: bool) -> tuple[float, list[list[int]]]:
    """``generate(prompts, params)`` of ``workload`` on ``engine``, greedy, from a cold prefix cache."""
    from kvserve import SamplingParams

    engine.async_scheduling = async_scheduling  # nothing is in flight between runs
    # Every run starts from a cold prefix cache: the runs share their prompts.
    if not engine.scheduler.kv_cache_manager.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset: blocks are still in use")
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.max_tokens]
    start = time.perf_counter()
    token_ids = generate(workload.prompts, params)
    elapsed = time.perf_counter() - start
    if [len(t) for t in token_ids] != workload.max_tokens:
        raise RuntimeError(f"{workload.name}: kvserve generated a different number of tokens than asked")
    return elapsed, token_ids


def run_step_protocol(llm_config, model_config, num_kv_blocks: int, workload: Workload,
                      in_process: dict[bool, tuple[float, list[list[int]]]]) -> list[list[str]]:
    """Rows of part (e): ``workload`` through a replica over the step protocol (``bench.grpc_replica``),
    plain and with async scheduling, against ``in_process[async_scheduling]`` = (seconds, outputs).

    The worker has the in-process replica's settings and block count, so the scheduler makes the
    same plans; ``RuntimeError`` unless every output equals in-process's token for token.
    """
    import dataclasses

    from kvserve.bench.grpc_replica import StepProtocolReplica, worker_server
    from kvserve.worker.worker import WorkerConfig

    worker_config = dataclasses.replace(WorkerConfig.for_engine(llm_config, model_config.max_model_len),
                                        num_blocks=num_kv_blocks)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the child sizes nothing from free memory, but needs room for the same cache
    over_grpc = {}
    with worker_server(worker_config) as (address, secret):
        replica = StepProtocolReplica(address, secret, llm_config, model_config)
        try:
            for async_scheduling in (False, True):
                _timed_run(replica.engine, replica.generate, warm_up(workload), async_scheduling)
                over_grpc[async_scheduling] = _timed_run(replica.engine, replica.generate, workload, async_scheduling)
        finally:
            replica.close()
    rows = []
    for async_scheduling, name in ((False, "plain"), (True, "async sched.")):
        (local_s, local_ids), (grpc_s, grpc_ids) = in_process[async_scheduling], over_grpc[async_scheduling]
        check_same_outputs(local_ids, grpc_ids, f"{workload.name}, {name}")
        tokens = workload.num_output_tokens
        rows.append([f"in-process, {name}", f"{local_s:.2f}", f"{tokens / local_s:.0f}", "1.00", "-"])
        rows.append([f"step protocol, {name}", f"{grpc_s:.2f}", f"{tokens / grpc_s:.0f}", f"{local_s / grpc_s:.2f}",
                     "equal"])
    return rows


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
    """Seconds for ``workload`` through a ``kvserve serve`` subprocess, all streams at once."""
    import asyncio

    import grpc

    from kvserve.proto import generate_pb2, generate_pb2_grpc

    server = subprocess.Popen(
        [sys.executable, "-c", "from kvserve.cli import main; raise SystemExit(main())", "serve", "--model", str(model_dir), "--device", device,
         "--port", str(port), "--max-concurrent-requests", "4096"]
        + ([] if device == "cuda" else ["--num-blocks", "4096"]),
        stdout=subprocess.DEVNULL, stderr=None,
    )

    async def one(stub, prompt: list[int], n: int) -> int:
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt),
            sampling_params=generate_pb2.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
        )
        return sum([len(message.token_ids) async for message in stub.Generate(request)])

    async def run() -> float:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.wait_for(channel.channel_ready(), timeout_s)
            stub = generate_pb2_grpc.GenerationStub(channel)
            deadline = time.monotonic() + timeout_s
            while True:  # the port opens before the replica is up: retry a short request
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

    try:
        return asyncio.run(run())
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--parts", default="abcde", help="which parts to run (default: abcde)")
    parser.add_argument("--batches", default="1,16,64,256", help="decode batch sizes (default: 1,16,64,256)")
    parser.add_argument("--decode-context", type=int, default=1024, help="prompt tokens of each decode request")
    parser.add_argument("--decode-steps", type=int, default=20, help="timed steps per batch and mode")
    parser.add_argument("--profile-batch", type=int, default=64,
                        help="after (a), the kernels of a decode step at this batch, on a GPU (0: off)")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the workloads' counts and lengths")
    parser.add_argument("--hf-prompts", type=int, default=64, help="prompts per workload for transformers")
    parser.add_argument("--hf-batch", type=int, default=64, help="transformers' batch size")
    parser.add_argument("--grpc-port", type=int, default=50077, help="port of part (d)'s server")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device == "cuda"
    read_rate = matmul_rate = None
    if on_gpu:
        read_rate, matmul_rate = ceilings()
        print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}: read {read_rate / 1e12:.2f} TB/s, "
              f"bf16 matmul {matmul_rate / 1e12:.0f} TFLOP/s", flush=True)
    if "b" in args.parts and on_gpu:
        from kvserve.bench.prefill_attention import CASES, prefill_table, run_case

        print("\n(b) prefill attention, 32/8 heads x 128, bf16\n")
        print(prefill_table([run_case(cached, new) for cached, new in CASES]), flush=True)
    if not set(args.parts) & set("acde"):
        return 0

    from kvserve import LLM
    from kvserve.worker.model_config import ModelConfig

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = model_dir_for(args, Path(scratch), num_hidden_layers=2)
        config = ModelConfig.from_pretrained(model_dir)
        from transformers import AutoConfig

        cost = model_cost(AutoConfig.from_pretrained(model_dir), dtype_bytes=2 if on_gpu else 4)
        workloads = make_workloads(config.vocab_size, args.scale, args.seed)
        mixed = workloads[0]
        kvserve_s: dict[str, float] = {}
        overlapped_s: dict[str, float] = {}
        in_process: dict[bool, tuple[float, list[list[int]]]] = {}  # mixed's, for (e)
        start = time.perf_counter()
        llm = LLM(model_dir, device=device, max_num_seqs=256, num_blocks=None if on_gpu else 4096)
        replica_settings = (llm.config, llm.model_config, llm.engine.executor.num_kv_blocks)
        print(f"\nLLM started in {time.perf_counter() - start:.1f} s", flush=True)
        try:
            if "a" in args.parts:
                batches = [int(b) for b in args.batches.split(",")]
                print(f"\n(a) decode step, {args.decode_context}-token prompts, median of {args.decode_steps} steps\n")
                rows = decode_steps(llm, batches, args.decode_context, config.vocab_size, args.decode_steps, cost,
                                    read_rate)
                print(format_table(["batch", "eager ms", "graphed ms", "graphed + async ms", "floor ms", "best / floor"],
                                   rows), flush=True)
                if on_gpu and args.profile_batch:
                    print(kernel_breakdown(llm, args.profile_batch, args.decode_context, config.vocab_size), flush=True)
            end_to_end = workloads if "c" in args.parts else [mixed] if "e" in args.parts else []
            if end_to_end:
                run_kvserve(llm, warm_up(mixed))
            for workload in end_to_end:
                plain, overlapped = run_kvserve(llm, workload), run_kvserve(llm, workload, async_scheduling=True)
                kvserve_s[workload.name], overlapped_s[workload.name] = plain[0], overlapped[0]
                if workload is mixed:
                    in_process = {False: plain, True: overlapped}
                print(f"  {workload.name}: {plain[0]:.2f} s, with async scheduling {overlapped[0]:.2f} s", flush=True)
        finally:
            llm.shutdown()
            del llm
        if "c" in args.parts:
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
            print(f"\n(c) end to end, each run from a cold prefix cache (transformers: the first "
                  f"{args.hf_prompts} prompts, batches of {args.hf_batch})\n")
            print(format_table(["workload", "requests", "output tokens", "kvserve s", "async sched. s", "kvserve tok/s",
                                "async tok/s", "transformers tok/s", "best vs transformers", "floor s",
                                "best / floor"], rows), flush=True)
        if "d" in args.parts:
            grpc_s = run_grpc(model_dir, mixed, args.grpc_port, device, timeout_s=300)
            local = kvserve_s.get(mixed.name)
            print(f"\n(d) the mixed workload through kvserve serve --device {device} and gRPC\n")
            print(format_table(
                ["path", "s", "tok/s", "vs in-process"],
                [["gRPC", f"{grpc_s:.2f}", f"{mixed.num_output_tokens / grpc_s:.0f}",
                  f"{local / grpc_s:.2f}" if local else "-"]]
                + ([["in-process", f"{local:.2f}", f"{mixed.num_output_tokens / local:.0f}", "1.00"]] if local else []),
            ), flush=True)
        if "e" in args.parts:
            rows = run_step_protocol(*replica_settings, mixed, in_process)
            print(f"\n(e) the mixed workload through the step protocol over gRPC on loopback, --device {device}: "
                  f"EngineCore + GrpcReplicaExecutor here, a StepWorker server and Worker in a child process; "
                  f"no Ray, no front end, not kvserve serve (that is (d)); greedy\n")
            print(format_table(["path", "s", "tok/s", "vs in-process (same scheduling)", "outputs vs in-process"],
                               rows), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
