"""Offline throughput: kvserve's ``LLM`` against transformers' batched ``generate()``.

Both run the same prompts, greedy, EOS ignored, float32 on CPU with the same
number of torch threads, in one run, each after a short warm-up:

(a) 64 prompts of 32–512 tokens, each asking for 64–128 new tokens.
    transformers generates one left-padded batch for the longest request
    (static batching); only the tokens each request asked for are counted.
(b) shared prefixes: 8 system prompts of 512 tokens, 64 questions (8 each).

kvserve runs every request at once (``max_num_seqs`` 256) with a budget of
4096 tokens per step (chunked prefill, prefix caching on, blocks of 16).

Figures: generated tokens per second for each engine and their ratio (kvserve's
over transformers': above 1, kvserve is faster), how many requests got the same
tokens from both, and the prefill tokens kvserve computed against the prompt
tokens.  Prints a line as each phase starts; exits 1 when a request got other
tokens from kvserve than from transformers, 2 on bad flags.

    python -m kvserve.bench.offline_throughput [--model DIR] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.bench.arg_types import int_at_least, model_directory
from kvserve.experiments.report import format_table
from kvserve.worker.tiny_model import create_tiny_model


def workload_a(rng: random.Random, vocab: int) -> tuple[list[list[int]], list[int]]:
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(32, 513))] for _ in range(64)]
    return prompts, [rng.randrange(64, 129) for _ in prompts]


def workload_b(rng: random.Random, vocab: int) -> tuple[list[list[int]], list[int]]:
    systems = [[rng.randrange(3, vocab) for _ in range(512)] for _ in range(8)]
    prompts = [
        systems[i % 8] + [rng.randrange(3, vocab) for _ in range(rng.randrange(16, 65))] for i in range(64)
    ]
    return prompts, [64] * len(prompts)


KVSERVE_ARGS = {"block_size": 16, "num_blocks": 8192, "max_num_batched_tokens": 4096, "max_num_seqs": 256}
HEADERS = ["workload", "generated tok", "transformers tok/s", "kvserve tok/s",
           "kvserve / transformers (>1: kvserve faster)", "same tokens", "prefill computed / prompt"]


@dataclass(frozen=True, slots=True)
class WorkloadResult:
    """One workload's run on both engines."""

    name: str
    num_requests: int
    num_generated: int
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens kvserve served from its prefix cache
    hf_s: float
    kv_s: float
    num_same: int  # requests that got the same tokens from both engines

    def row(self) -> list[object]:
        return [
            self.name, self.num_generated, f"{self.num_generated / self.hf_s:.0f}",
            f"{self.num_generated / self.kv_s:.0f}", f"{self.hf_s / self.kv_s:.2f}x",
            f"{self.num_same} / {self.num_requests}",
            f"{self.num_prompt_tokens - self.num_cached_tokens} / {self.num_prompt_tokens}",
        ]


def mismatches(results: list[WorkloadResult]) -> list[str]:
    """A line for each workload where some request got other tokens from the two engines (none: all agree)."""
    return [f"MISMATCH: {r.name}: {r.num_requests - r.num_same} of {r.num_requests} requests got other tokens "
            "from kvserve than from transformers" for r in results if r.num_same != r.num_requests]


def run_transformers(
    model, prompts: list[list[int]], max_new: list[int], batch_size: int
) -> tuple[float, list[list[int]]]:
    """Seconds to generate, in left-padded batches of ``batch_size``, and the tokens each request asked for."""
    model.generation_config.eos_token_id = None
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            generated = model.generate(ids, attention_mask=mask, max_new_tokens=max(max_new[i : i + batch_size]),
                                       do_sample=False, pad_token_id=0)
        outputs.extend(row[width : width + n] for row, n in zip(generated.tolist(), max_new[i : i + batch_size]))
    return time.perf_counter() - start, outputs


def run_kvserve(llm: LLM, prompts: list[list[int]], max_new: list[int]) -> tuple[float, int, list[list[int]]]:
    """Seconds to generate, prompt tokens served from the prefix cache, and the generated tokens."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_new]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    if [len(o.token_ids) for o in outputs] != max_new:
        raise RuntimeError("kvserve generated a different number of tokens than asked")
    return elapsed, sum(o.num_cached_tokens for o in outputs), [o.token_ids for o in outputs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=model_directory, help="model directory (default: a fresh tiny Llama)")
    parser.add_argument("--threads", type=int_at_least(1), default=torch.get_num_threads(),
                        help="torch CPU threads of both engines (default here: %(default)s, torch's own)")
    parser.add_argument("--hf-batch-size", type=int_at_least(1), default=64,
                        help="transformers batch size (default 64)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or create_tiny_model(Path(tmp) / "tiny", "llama", seed=0)
        # A temporary model is gone by the time the table is printed: it is named, not its path.
        model_name = args.model or "a fresh tiny Llama (random weights)"
        print(f"loading {model_name} into transformers ...", flush=True)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        vocab = hf.config.vocab_size
        results = []
        for name, make in (("(a) 64 prompts, 32-512 tok", workload_a), ("(b) 8 x 512 shared prefix", workload_b)):
            prompts, max_new = make(random.Random(0), vocab)
            # Both engines warm up on the first two prompts (4 tokens each) before the timed run.
            print(f"{name}: kvserve, {len(prompts)} requests ...", flush=True)
            with LLM(model_dir, seed=0, **KVSERVE_ARGS) as llm:
                run_kvserve(llm, prompts[:2], [4, 4])
                llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
                kv_s, num_cached, kv_tokens = run_kvserve(llm, prompts, max_new)
            print(f"{name}: transformers, batches of {args.hf_batch_size} ...", flush=True)
            run_transformers(hf, prompts[:2], [4, 4], args.hf_batch_size)
            hf_s, hf_tokens = run_transformers(hf, prompts, max_new, args.hf_batch_size)
            results.append(WorkloadResult(
                name, len(prompts), sum(max_new), sum(len(p) for p in prompts), num_cached, hf_s, kv_s,
                sum(a == b for a, b in zip(kv_tokens, hf_tokens)),
            ))
    print()
    print(f"offline generation, greedy, float32 CPU, {args.threads} threads, model {model_name}")
    print(f"kvserve: {', '.join(f'{k} {v}' for k, v in KVSERVE_ARGS.items())}; "
          f"transformers: left-padded batches of {args.hf_batch_size}")
    print(format_table(HEADERS, [r.row() for r in results]))
    for line in mismatches(results):
        print(line)
    return 1 if mismatches(results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
