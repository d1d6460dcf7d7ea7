"""Part (a) of ``bench.gpu_serving``: a decode step's time at fixed batch sizes, and where it goes.

Each batch is ``batch`` requests of ``context`` random tokens, stepped until all decode,
then timed step by step (``engine.step()``: schedule, execute, update), eager, through CUDA
graphs and through graphs with async scheduling.  The KV pool must hold every request to
its last token (``decode_pool_blocks``): a preempted request would leave the batch.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
import warnings
from collections.abc import Iterator

import torch

from kvserve.experiments.report import format_table

DECODE_HEADERS = ["batch", "eager ms", "graphed ms", "graphed + async ms", "floor ms", "best / floor"]


def decode_max_tokens(batch: int, context: int, steps: int, max_num_batched_tokens: int) -> int:
    """New tokens each request of a timed batch may make: enough that none ends while the batch is
    timed (two warm-up and ``steps`` timed steps in each of three modes), though the first prompts
    start decoding while the last ones are still prefilled."""
    return 4 * steps + 8 + -(-batch * context // max_num_batched_tokens)


def decode_pool_blocks(batches: tuple[int, ...], context: int, steps: int, max_num_batched_tokens: int,
                       block_size: int) -> int:
    """KV blocks (the null block included) that hold the largest of ``batches`` to its last token."""

    def blocks(batch: int) -> int:
        # NOTE: one token more than the request's own: with async scheduling the next step's slot is
        # allocated while the step before runs.
        tokens = context + decode_max_tokens(batch, context, steps, max_num_batched_tokens) + 1
        return batch * -(-tokens // block_size)

    return 1 + max(blocks(batch) for batch in batches)


def decode_table_head() -> str:
    """The decode table's header and rule; its columns are as wide as the headers."""
    return format_table(DECODE_HEADERS, [])


def decode_row_line(cells: list[object]) -> str:
    """One row of the decode table in ``format_table``'s layout, to print as soon as it is measured."""
    return format_table(DECODE_HEADERS, [cells]).splitlines()[-1]


def decode_steps(llm, batches: tuple[int, ...], context: int, vocab: int, steps: int, cost,
                 read_rate: float | None) -> Iterator[list[str]]:
    """Rows of part (a), each as soon as it is measured: per batch, the median step time of each mode
    and the floor.  ``RuntimeError`` if a request left the running batch while it was timed."""
    engine, worker = llm.engine, llm.engine.executor.worker
    graphs = worker.decode_graphs
    scheduler = engine.scheduler
    for batch in batches:
        req_ids = _start_decoding(engine, batch, context, vocab, steps, f"decode-{batch}", seed=batch)
        tokens_before = sum(r.num_tokens for r in scheduler.running)
        preemptions_before = scheduler.num_preemptions
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
        running = scheduler.running
        check_batch_kept(scheduler, req_ids, scheduler.num_preemptions - preemptions_before)
        tokens_after = sum(r.num_tokens for r in running)
        _abort_all(engine, req_ids)
        engine.async_scheduling = False
        floor_ms = None
        if read_rate is not None:  # K/V read by a step: the mean of the tokens held while timed
            kv_bytes = (tokens_before + tokens_after) / 2 * cost.kv_bytes_per_token
            floor_ms = (cost.weight_bytes + kv_bytes) / read_rate * 1e3
        best = min(times.values())
        yield [batch, *(f"{times[m]:.2f}" if m in times else "-" for m in ("eager", "graphed", "overlapped")),
               f"{floor_ms:.2f}" if floor_ms else "-", f"{best / floor_ms:.2f}" if floor_ms else "-"]


def check_batch_kept(scheduler, req_ids: list[str], num_preemptions: int) -> None:
    """``RuntimeError`` saying what happened unless every one of ``req_ids`` is still running and
    none was preempted (``num_preemptions``: while the batch was timed)."""
    running = {r.req_id for r in scheduler.running}
    if num_preemptions == 0 and running.issuperset(req_ids):
        return
    waiting = {r.req_id for r in scheduler.waiting}
    num_waiting = sum(1 for req_id in req_ids if req_id in waiting)
    num_finished = sum(1 for req_id in req_ids if req_id not in running and req_id not in waiting)
    usable = scheduler.kv_cache_manager.block_pool.num_usable_blocks
    raise RuntimeError(
        f"batch {len(req_ids)}: while its steps were timed, {num_preemptions} preemptions (the KV pool holds "
        f"{usable} usable blocks); at the end {len(req_ids) - num_waiting - num_finished} requests were running, "
        f"{num_waiting} preempted and waiting, {num_finished} finished")


def _start_decoding(engine, batch: int, context: int, vocab: int, steps: int, tag: str, seed: int) -> list[str]:
    """``batch`` requests of ``context`` random tokens (none shared with another ``seed``'s),
    stepped until every one is decoding."""
    from kvserve import SamplingParams
    from kvserve.scheduler.request import Request

    generator = torch.Generator().manual_seed(seed)
    req_ids = []
    budget = engine.scheduler.scheduler_config.max_num_batched_tokens
    max_tokens = decode_max_tokens(batch, context, steps, budget)
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


def launch_profile(engine, worker, steps: int, top: int = 14, *, by_own_time: bool = False) -> str:
    """Where the host's launch of a step goes: the ``top`` functions under ``Worker.launch`` by
    cumulative time per step, or by their own time (``by_own_time``: what an eager step's hundreds
    of launches spend in each kind of call); cProfile's own overhead inflates every figure."""
    profiler = cProfile.Profile()
    launch = worker.launch

    def profiled(plan):
        profiler.enable()
        try:
            return launch(plan)
        finally:
            profiler.disable()

    worker.launch = profiled
    try:
        for _ in range(steps):
            engine.step()
    finally:
        del worker.launch
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, self s, cumulative s, callers)
    entries = sorted(stats.items(), key=lambda item: item[1][2 if by_own_time else 3], reverse=True)
    rows = [[f"{name} ({file.rsplit('/', 1)[-1]}:{line})"[:70], f"{calls / steps:.0f}", f"{cumulative / steps * 1e6:.0f}",
             f"{own / steps * 1e6:.0f}"]
            for (file, line, name), (_, calls, own, cumulative, _) in entries[:top]]
    return format_table(["function (cProfile)", "calls / step", "cumulative us / step", "own us / step"], rows)


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
        if mode != "overlapped":
            lines.append(f"the host's launch of {'an' if mode == 'eager' else 'a'} {mode} step, batch {batch}, "
                         f"{steps} steps:\n")
            lines.append(launch_profile(engine, worker, steps, top=20 if mode == "eager" else 14,
                                        by_own_time=mode == "eager") + "\n")
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
