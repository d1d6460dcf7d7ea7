"""``kvserve serve``'s engine settings: the flags of the model runtime, the KV cache and the
step scheduler, and the ``EngineConfig`` they give.  A flag's dest is its setting's name, so
an error about a setting names its flag (``cli_serve._in_flag_terms``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvserve.scheduler.engine_config import ATTENTION_BACKENDS, DTYPES, EngineConfig

# NOTE: kvserve.worker.worker.DEFAULT_CPU_KV_CACHE_BYTES in MiB, spelled out so that
# `kvserve serve --help` need not import torch (a test keeps the two equal).
CPU_KV_CACHE_MIB = 512


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine settings that have no flag among serve's main ones (those that size and place replicas)."""
    engine = parser.add_argument_group("model runtime, KV cache and scheduling (every replica)")
    engine.add_argument(
        "--dtype", choices=DTYPES, default=None,
        help="weights' and activations' type (default: auto: bfloat16 on GPUs, float32 on CPU)",
    )
    engine.add_argument(
        "--seed", type=int, default=None, metavar="N",
        help=f"seeds the sampling of requests without a seed of their own (default: {engine_default('seed')})",
    )
    engine.add_argument(
        "--gpu-memory-utilization", type=float, default=None, metavar="F",
        help="without --num-blocks: the share of each GPU's memory that may be in use once the KV cache is "
        f"allocated (weights and all), in (0, 1] (default: {engine_default('gpu_memory_utilization')})",
    )
    engine.add_argument(
        "--cpu-kv-cache-bytes", type=int, default=None, metavar="N",
        help=f"without --num-blocks, on CPU: bytes of KV cache per rank (default: {CPU_KV_CACHE_MIB} MiB)",
    )
    engine.add_argument(
        "--no-prefix-caching", action="store_const", const=False, default=None, dest="enable_prefix_caching",
        help="never reuse cached blocks of earlier prompts (every prompt is computed in full)",
    )
    engine.add_argument(
        "--tenant-cache-share", type=float, default=None, metavar="F",
        help="with --auth-token-file: while a tenant's cached blocks hold more than F of a replica's KV "
        "cache (F in (0, 1]), the others' cached blocks are evicted last: new blocks come from free uncached "
        "ones, then from that tenant's own cache, so that one tenant's flood of unique prompts cannot wipe "
        "the others' prefix cache (default: off: one LRU order for all tenants)",
    )
    engine.add_argument(
        "--no-chunked-prefill", action="store_const", const=False, default=None, dest="enable_chunked_prefill",
        help="compute each prompt in one step (then --max-num-batched-tokens must be at least --max-model-len)",
    )
    engine.add_argument(
        "--long-prefill-token-threshold", type=int, default=None, metavar="N",
        help="a prompt's chunk in one step holds at most N tokens, so that long prompts share steps "
        "(default: no limit but the step's budget)",
    )
    engine.add_argument(
        "--attention-backend", choices=ATTENTION_BACKENDS, default=None,
        help="the attention kernels (default: the device's: cuda on GPUs, cpu on CPU, torch where "
        "neither builds)",
    )
    engine.add_argument(
        "--cpu-threads", type=int, default=None, metavar="N",
        help="torch threads of each CPU rank (default: the cores this process may use, divided among a "
        "replica's ranks)",
    )


def engine_config(args: argparse.Namespace, model_dir: str | Path) -> EngineConfig:
    """The engine settings serve's flags (``args``) give for ``model_dir``; a flag not given keeps the default."""
    # NOTE: a flag's dest is its setting's name (``--tp``: tensor_parallel_size).
    settings = {name: getattr(args, name) for name in EngineConfig.field_names() if hasattr(args, name)}
    return EngineConfig.from_kwargs(str(model_dir), **{k: v for k, v in settings.items() if v is not None})


def engine_default(name: str) -> object:
    """The default of the engine's setting ``name`` (``EngineConfig``), for --help."""
    return EngineConfig.default(name)
