"""``kvserve serve``'s engine settings: the flags of the model runtime, the KV cache and the
step scheduler, the ``EngineConfig`` they give, and the warning of a setting that only the
started replicas' pool sizes can judge (``--tenant-cache-share``).  A flag's dest is its setting's name, so
an error about a setting names its flag (``cli_flag_terms``)."""

from __future__ import annotations

import argparse
import logging
import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from kvserve.scheduler.engine_config import ATTENTION_BACKENDS, DTYPES, EngineConfig
from kvserve.scheduler.tenant_block_pool import blocks_within_share

logger = logging.getLogger(__name__)

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


def warn_of_a_small_tenant_cache_share(engine: EngineConfig, max_model_len: int, pool_sizes: Iterable[int]) -> None:
    """Log a WARNING, once for each size among the replicas' block pools (``pool_sizes``: their
    ``num_kv_blocks``), where ``--tenant-cache-share`` keeps fewer blocks per tenant within its
    share than one prompt of ``max_model_len`` tokens fills: a tenant's protected cache cannot hold
    even one longest prompt's prefix.  Nothing without a share, or without prefix caching."""
    cache = engine.cache
    share = cache.tenant_cache_share
    if share is None or not cache.enable_prefix_caching:
        return
    num_needed = -(-max_model_len // cache.block_size)
    for num_blocks, num_replicas in Counter(pool_sizes).items():
        num_protected = blocks_within_share(num_blocks, share)
        if num_protected >= num_needed:
            continue
        num_usable = num_blocks - 1
        # The least share that would do, rounded up to a hundredth (none does in a pool smaller than the prompt).
        least = math.ceil(num_needed / num_usable * 100) / 100
        advice = f"; --tenant-cache-share {least:g} or more would" if least <= 1 else ""
        logger.warning(
            "--tenant-cache-share %g protects %d of a replica's %d usable KV blocks (%d tokens) per tenant "
            "(%d replica(s) of that size), fewer than the %d blocks one prompt of max_model_len (%d tokens) "
            "fills: a tenant's protected prefix cache cannot hold one full-length prompt%s",
            share, num_protected, num_usable, num_protected * cache.block_size, num_replicas,
            num_needed, max_model_len, advice,
        )
