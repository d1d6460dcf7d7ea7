"""The end-to-end workloads of ``bench.gpu_serving``, and their floors on a device.

* ``mixed``: 256 prompts of 128-1,024 tokens, 128 new tokens each;
* ``long_decode``: 64 prompts of 32 tokens, 512 new tokens each;
* ``shared_prefix``: 8 system prompts of 1,024 tokens x 32 questions of 64 tokens, 64 new each.

``scale`` shrinks the counts and lengths (for a CPU smoke run).  A workload's floor is
the time a device needs for its arithmetic and its memory traffic at the measured
rates, every request in flight at once: prefill FLOPs (the prompt tokens a prefix
cache cannot serve) at the matmul rate, plus, per decode step, the weights and every
running request's K/V at the read rate.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    # Per request, the prompt tokens a prefix cache can serve (a system prompt seen before).
    cached_tokens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


@dataclass(frozen=True, slots=True)
class ModelCost:
    """What one token costs a model: FLOPs of its matmuls and the bytes a decode step reads."""

    matmul_flops_per_token: float  # 2 x parameters used per token (embedding lookup aside)
    attention_flops_per_pair: float  # per (query, key) pair, all layers: 4 x heads x head_dim x layers
    weight_bytes: float  # read once per decode step
    kv_bytes_per_token: float  # K and V of one token, all layers


def make_workloads(vocab_size: int, scale: float = 1.0, seed: int = 0) -> list[Workload]:
    rng = random.Random(seed)

    def n(count: int) -> int:
        return max(1, round(count * scale))

    def tokens(length: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(length)]

    mixed = [tokens(rng.randrange(n(128), n(1024) + 1)) for _ in range(n(256))]
    long_decode = [tokens(n(32)) for _ in range(n(64))]
    systems = [tokens(n(1024)) for _ in range(n(8))]
    shared = [system + tokens(n(64)) for system in systems for _ in range(n(32))]
    rng.shuffle(shared)
    seen: set[tuple[int, ...]] = set()
    shared_cached = []
    for prompt in shared:
        system = tuple(prompt[: n(1024)])
        shared_cached.append((n(1024) // 16) * 16 if system in seen else 0)  # whole blocks of 16
        seen.add(system)
    return [
        Workload("mixed", mixed, [n(128)] * len(mixed), [0] * len(mixed)),
        Workload("long_decode", long_decode, [n(512)] * len(long_decode), [0] * len(long_decode)),
        Workload("shared_prefix", shared, [n(64)] * len(shared), shared_cached),
    ]




def model_cost(config, dtype_bytes: int = 2) -> ModelCost:
    """The cost of a Hugging Face config's model (Llama family)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = config.intermediate_size
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    lm_head = config.vocab_size * hidden
    params_per_token = layers * per_layer + lm_head
    return ModelCost(
        matmul_flops_per_token=2.0 * params_per_token,
        attention_flops_per_pair=4.0 * heads * head_dim * layers,
        weight_bytes=float(params_per_token + layers * 2 * hidden + hidden) * dtype_bytes,
        kv_bytes_per_token=2.0 * layers * kv_heads * head_dim * dtype_bytes,
    )


def workload_floor_s(workload: Workload, cost: ModelCost, matmul_flops_per_s: float, read_bytes_per_s: float) -> float:
    """The workload's floor (module docstring), in seconds."""
    prompt_tokens = sum(len(p) - c for p, c in zip(workload.prompts, workload.cached_tokens))
    # Attention of the computed prompt tokens: their causal (query, key) pairs.
    pairs = sum((len(p) * (len(p) + 1) - c * (c + 1)) / 2 for p, c in zip(workload.prompts, workload.cached_tokens))
    prefill_s = (prompt_tokens * cost.matmul_flops_per_token + pairs * cost.attention_flops_per_pair) / matmul_flops_per_s
    num_steps = max(workload.max_tokens)
    kv_tokens_read = 0.0
    for step in range(num_steps):
        kv_tokens_read += sum(len(p) + step for p, m in zip(workload.prompts, workload.max_tokens) if step < m)
    decode_s = (num_steps * cost.weight_bytes + kv_tokens_read * cost.kv_bytes_per_token) / read_bytes_per_s
    return prefill_s + decode_s
