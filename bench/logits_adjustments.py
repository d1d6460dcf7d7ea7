"""What penalties, logit biases and ``min_tokens`` cost: the same workload with and without them.

One ``LLM``, one run, greedy, EOS ignored: 64 prompts of 32-256 tokens, each asking
for 64 new tokens, generated

(a) plainly (the baseline);
(b) with a presence and a frequency penalty and 8 logit biases on every request
    (counts of every request's tokens kept on the device, updated each step);
(c) with ``min_tokens`` on every request, holding back 8 stop tokens;
(d) with the adjustments of (b) on a quarter of the requests only;
(e) with a repetition penalty on every request (its prompt's tokens marked on the device too).

Each workload runs twice and the faster run counts.  Figures: generated tokens per
second and the ratio to (a) (1.0: free; below, the share of the speed the adjustments
cost).  Exits 1 when an adjusted run generated other token counts than asked, 2 on bad flags.

    python -m kvserve.bench.logits_adjustments [--model DIR] [--device cpu|cuda] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.arg_types import int_at_least, model_directory
from kvserve.experiments.report import format_table
from kvserve.worker.tiny_model import create_tiny_model

NUM_REQUESTS = 64
MAX_TOKENS = 64
HEADERS = ["workload", "generated tok", "tok/s", "vs plain"]


def workloads(vocab: int) -> dict[str, list[SamplingParams]]:
    greedy = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    rng = random.Random(1)
    biased = {rng.randrange(vocab): rng.uniform(-5.0, 5.0) for _ in range(8)}
    penalised = SamplingParams(**greedy, presence_penalty=0.5, frequency_penalty=0.5, logit_bias=biased)
    held_back = SamplingParams(**greedy, min_tokens=MAX_TOKENS, stop_token_ids=tuple(range(3, 11)))
    repeated = SamplingParams(**greedy, repetition_penalty=1.2)
    plain = SamplingParams(**greedy)
    return {
        "(a) plain": [plain] * NUM_REQUESTS,
        "(b) penalties + 8 biases, all": [penalised] * NUM_REQUESTS,
        "(c) min_tokens, 8 stop ids, all": [held_back] * NUM_REQUESTS,
        "(d) penalties + 8 biases, 1 in 4": [penalised if i % 4 == 0 else plain for i in range(NUM_REQUESTS)],
        "(e) repetition penalty, all": [repeated] * NUM_REQUESTS,
    }


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    """Seconds of the faster of two runs, and the tokens generated."""
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, progress=False)
        best = min(best, time.perf_counter() - start)
    return best, sum(len(o.token_ids) for o in outputs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=model_directory, help="model directory (default: a fresh tiny Llama)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs (default cpu)")
    parser.add_argument("--threads", type=int_at_least(1), default=torch.get_num_threads(),
                        help="torch CPU threads (default here: %(default)s, torch's own)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or create_tiny_model(Path(tmp) / "tiny", "llama", seed=0)
        model_name = args.model or "a fresh tiny Llama (random weights)"
        rows, failures = [], []
        with LLM(model_dir, device=args.device, seed=0, num_blocks=2048, max_num_seqs=NUM_REQUESTS) as llm:
            vocab = llm.model_config.vocab_size
            rng = random.Random(0)
            prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(32, 257))] for _ in range(NUM_REQUESTS)]
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), progress=False)  # warm-up
            baseline = None
            for name, params in workloads(vocab).items():
                print(f"{name} ...", flush=True)
                seconds, generated = timed(llm, prompts, params)
                if generated != NUM_REQUESTS * MAX_TOKENS:
                    failures.append(f"{name}: {generated} tokens generated, {NUM_REQUESTS * MAX_TOKENS} asked for")
                speed = generated / seconds
                baseline = baseline or speed
                rows.append([name, generated, f"{speed:.0f}", f"{speed / baseline:.2f}x"])
    print()
    print(f"logits adjustments, greedy, {args.device}, {args.threads} threads, model {model_name}, "
          f"{NUM_REQUESTS} requests x {MAX_TOKENS} tokens, best of 2")
    print(format_table(HEADERS, rows))
    for line in failures:
        print(f"FAILED: {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
