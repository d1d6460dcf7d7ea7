"""Offline throughput: kvserve's ``LLM`` against transformers' batched ``generate()``.

Both run the same prompts, greedy, EOS ignored, float32 on CPU with the same
number of torch threads, in one run, each after a short warm-up:

(a) 64 prompts of 32–512 tokens, each asking for 64–128 new tokens.
    transformers generates one left-padded batch for the longest request
    (static batching); only the tokens each request asked for are counted.
(b) shared prefixes: 8 system prompts of 512 tokens, 64 questions (8 each).

kvserve runs every request at once (``max_num_seqs`` 256) with a budget of
4096 tokens per step (chunked prefill, prefix caching on, blocks of 16).

Figures: generated tokens per second for each engine and their ratio, how many
requests got the same tokens from both, and the prefill tokens kvserve computed
against the prompt tokens.

    python -m kvserve.bench.offline_throughput [--model DIR] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.bench.arg_types import int_at_least
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
    parser.add_argument("--model", type=Path, help="model directory (default: a fresh tiny Llama)")
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
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        vocab = hf.config.vocab_size
        rows = []
        for name, make in (("(a) 64 prompts, 32-512 tok", workload_a), ("(b) 8 x 512 shared prefix", workload_b)):
            prompts, max_new = make(random.Random(0), vocab)
            num_generated = sum(max_new)
            num_prompt = sum(len(p) for p in prompts)
            # Both engines warm up on the first two prompts (4 tokens each) before the timed run.
            with LLM(model_dir, seed=0, **KVSERVE_ARGS) as llm:
                run_kvserve(llm, prompts[:2], [4, 4])
                llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
                kv_s, num_cached, kv_tokens = run_kvserve(llm, prompts, max_new)
            run_transformers(hf, prompts[:2], [4, 4], args.hf_batch_size)
            hf_s, hf_tokens = run_transformers(hf, prompts, max_new, args.hf_batch_size)
            num_same = sum(a == b for a, b in zip(kv_tokens, hf_tokens))
            rows.append([
                name, num_generated, f"{num_generated / hf_s:.0f}", f"{num_generated / kv_s:.0f}",
                f"{hf_s / kv_s:.2f}x", f"{num_same} / {len(prompts)}", f"{num_prompt - num_cached} / {num_prompt}",
            ])
    print(f"offline generation, greedy, float32 CPU, {args.threads} threads, model {model_name}")
    print(f"kvserve: {', '.join(f'{k} {v}' for k, v in KVSERVE_ARGS.items())}; "
          f"transformers: left-padded batches of {args.hf_batch_size}")
    print(format_table(
        ["workload", "generated tok", "transformers tok/s", "kvserve tok/s", "ratio", "same tokens",
         "prefill computed / prompt"],
        rows,
    ))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
