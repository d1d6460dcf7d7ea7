"""Streaming throughput of the three ways in: HTTP (OpenAI SSE), gRPC, and the in-process engine.

The same prompts and settings (greedy, EOS ignored; every prompt shorter than a
KV block, so that no round reuses another's cached prefix) through:

* gRPC: ``kvserve serve`` in a child process, and ``kvserve.client.AsyncClient``
  here opening every ``Generate`` stream at once and reading them to the end;
* HTTP: the same server, ``POST /v1/completions`` with ``stream: true`` for
  every request at once (``aiohttp``), reading the server-sent events to ``[DONE]``;
* in process: ``kvserve.LLM(...).generate(all prompts)`` after the server stopped.

gRPC and HTTP take turns, a run of each per round; each figure is the best of
``--repeat`` rounds.  The clock runs from the first request sent to the last
message received.  The figure that matters is HTTP's generated tokens per
second against gRPC's (target >= 0.9 at 64 streams on the tiny model): the
HTTP layer's own cost, since both share the server's request pipeline.

Prints a line as each phase starts.  The server gets ``STARTUP_TIMEOUT_S`` to
start, whether it prints or not; on Ctrl-C or SIGTERM, at any stage, it is
stopped with whatever its session started (Ray's processes too).

    python -m kvserve.bench.http_throughput [--model DIR] [--streams N] [--max-tokens T] [--repeat R]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from kvserve.bench.arg_types import int_at_least, model_directory
from kvserve.bench.serve_process import STARTUP_TIMEOUT_S, ServeProcess
from kvserve.cluster.interrupts import sigterm_as_interrupt
from kvserve.experiments.report import format_table

if TYPE_CHECKING:
    import aiohttp

    from kvserve.client import AsyncClient

TARGET_RATIO = 0.9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.bench.http_throughput", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", type=model_directory, default=None,
                        help="model directory (default: the embedded tiny model)")
    parser.add_argument("--streams", type=int_at_least(1), default=64, help="concurrent streams (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int_at_least(1), default=64,
                        help="tokens generated per stream (default: %(default)s)")
    parser.add_argument("--repeat", type=int_at_least(1), default=3,
                        help="rounds; the best of each is kept (default: %(default)s)")
    args = parser.parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        from kvserve.worker.tiny_model import ensure_default_tiny_model

        model_dir = ensure_default_tiny_model()
    prompts = [f"Stream number {i} tells a story about" for i in range(args.streams)]
    expected_tokens = args.streams * args.max_tokens
    from kvserve.worker.model_config import ModelConfig
    from kvserve.worker.tokenizer import load_tokenizer

    # Checked before the server starts: a request past the model's context is refused mid-run.
    max_model_len = ModelConfig.from_pretrained(model_dir).max_model_len
    tokenizer = load_tokenizer(model_dir)
    longest = max(len(tokenizer(prompt)["input_ids"]) for prompt in prompts) if tokenizer is not None else 0
    if longest + args.max_tokens > max_model_len:
        parser.error(f"--max-tokens: at most {max_model_len - longest} (the model's {max_model_len} tokens less the "
                     f"longest prompt's {longest}), got {args.max_tokens}")

    with sigterm_as_interrupt(), served(model_dir, args.streams) as (grpc_target, http_url, model_name):
        print(f"serving on {grpc_target} (gRPC) and {http_url} (HTTP); {args.repeat} round(s) of {args.streams} "
              f"streams of {args.max_tokens} tokens each way ...", flush=True)
        best = asyncio.run(_rounds(grpc_target, http_url, model_name, prompts, args.max_tokens, args.repeat))
    print("server stopped; in process ...", flush=True)
    best["in process"] = _in_process(model_dir, prompts, args.max_tokens, args.repeat)
    print()

    rows = [(name, args.streams, expected_tokens, rate, rate / best["gRPC"]) for name, rate in best.items()]
    print(format_table(["way in", "streams", "tokens", "tokens/s", "vs gRPC"], rows))
    ratio = best["HTTP"] / best["gRPC"]
    verdict = "meets" if ratio >= TARGET_RATIO else "misses"
    print(f"\nHTTP / gRPC = {ratio:.2f} ({verdict} the target of {TARGET_RATIO})")
    return 0


@contextmanager
def served(model_dir: Path, max_streams: int,
           startup_timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[tuple[str, str, str]]:
    """``kvserve serve`` (gRPC and HTTP on free ports) in a session of its own: its gRPC target, HTTP URL, model name.

    ``RuntimeError`` with what it printed if it does not start within ``startup_timeout_s``, printing or
    not (its output is read by a thread of its own).  However the block ends (an exception, Ctrl-C, a
    SIGTERM under ``sigterm_as_interrupt``, the timeout), serve is stopped, and its session's processes.
    """
    args = ["--model", str(model_dir), "--port", "0", "--http-port", "0", "--num-blocks",
            str(max(256, max_streams * 16)), "--max-concurrent-requests", str(max_streams * 2)]
    print(f"starting kvserve serve --model {model_dir} (gRPC and HTTP on free ports) ...", flush=True)
    with ServeProcess(args) as serve:
        port = serve.wait_for_port(startup_timeout_s)
        # NOTE: serve prints the HTTP API's address before it says it listens.
        pattern = re.compile(r"OpenAI-compatible API at (http://[^/\s]+)/v1")
        urls = [match[1] for line in serve.output if (match := pattern.search(line))]
        if not urls:
            raise RuntimeError("kvserve serve listens on gRPC but did not say where its HTTP API is:\n"
                               + "\n".join(serve.output[-30:]))
        yield f"127.0.0.1:{port}", urls[0], Path(model_dir).name


async def _rounds(
    grpc_target: str, http_url: str, model: str, prompts: list[str], max_tokens: int, repeat: int
) -> dict[str, float]:
    """The best generated tokens per second of each way in; each keeps its connections between rounds."""
    import aiohttp

    from kvserve.client import AsyncClient

    # NOTE: aiohttp (a dependency of Ray's): httpx's pool spent more CPU than the server at 64 streams.
    connector = aiohttp.TCPConnector(limit=len(prompts) + 1)
    async with AsyncClient(grpc_target) as grpc_client, aiohttp.ClientSession(
        http_url, connector=connector, timeout=aiohttp.ClientTimeout(total=120.0)
    ) as http_client:
        ways = {
            "gRPC": lambda ps, n: _grpc(grpc_client, ps, n),
            "HTTP": lambda ps, n: _http(http_client, model, ps, n),
        }
        for run in ways.values():  # warm-up: the model's first steps, the connections, the app's first requests
            await run(prompts, 2)
        best: dict[str, float] = {}
        for round_index in range(repeat):
            print(f"  round {round_index + 1} of {repeat}: {', '.join(ways)}", flush=True)
            for name, run in ways.items():
                start = time.perf_counter()
                num_tokens = await run(prompts, max_tokens)
                elapsed = time.perf_counter() - start
                if num_tokens != len(prompts) * max_tokens:
                    raise RuntimeError(f"{name}: {num_tokens} tokens generated, expected {len(prompts) * max_tokens}")
                best[name] = max(best.get(name, 0.0), num_tokens / elapsed)
    return best


async def _grpc(client: AsyncClient, prompts: list[str], max_tokens: int) -> int:
    async def one(prompt: str) -> int:
        completion = await client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return completion.usage.completion_tokens

    return sum(await asyncio.gather(*(one(p) for p in prompts)))


async def _http(client: aiohttp.ClientSession, model: str, prompts: list[str], max_tokens: int) -> int:
    async def one(prompt: str) -> int:
        body = {
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
        }
        num_tokens = 0
        async with client.post("/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.content:  # one server-sent event line at a time
                if line.startswith(b"data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        num_tokens = usage["completion_tokens"]
        return num_tokens

    return sum(await asyncio.gather(*(one(p) for p in prompts)))


def _in_process(model_dir: Path, prompts: list[str], max_tokens: int, repeat: int) -> float:
    from kvserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    best = 0.0
    with LLM(model_dir, num_blocks=max(256, len(prompts) * 16), enable_prefix_caching=False) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        for _ in range(repeat):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            best = max(best, sum(len(o.token_ids) for o in outputs) / elapsed)
    return best


if __name__ == "__main__":
    sys.exit(main())
