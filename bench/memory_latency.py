"""How long this machine takes to read a Python object that is not in the CPU's caches.

The fleet simulator is largely bound by memory latency: each step of each
replica touches that replica's requests, blocks and lists, which a thousand
other replicas' steps have pushed out of the caches since, and a profile's
costly lines are the first touch of each.  Its wall time therefore moves with
the machine's memory latency at least as much as with its clock, and a
figure measured on one machine says little about another without this one
beside it (the read in order tracks the clock).

The probe reads ``num_reads`` ints of a list of ``num_objects`` distinct int
objects (4M by default: about 160 MB, past any L3), once in a random order and
once in the order they were allocated.  A random read misses twice (the
list's slot, then the object); a read in order mostly hits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ObjectReadTimes:
    """Nanoseconds per read of an int object, in random order and in allocation order."""

    random_ns: float
    sequential_ns: float


def object_read_times(num_objects: int = 4_000_000, num_reads: int = 1_000_000, seed: int = 0) -> ObjectReadTimes:
    """Time reads of ``num_reads`` of ``num_objects`` int objects, best of three passes each way."""
    if num_objects < 1 or not 1 <= num_reads <= num_objects:
        raise ValueError(f"need 1 <= num_reads <= num_objects, got {num_reads}, {num_objects}")
    # Values past 256 are separate heap objects (small ints are shared).
    objects = [i * 1_000_003 + 257 for i in range(num_objects)]
    random_order = np.random.default_rng(seed).permutation(num_objects)[:num_reads].tolist()
    in_order = list(range(num_reads))
    return ObjectReadTimes(
        random_ns=_best_ns_per_read(objects, random_order),
        sequential_ns=_best_ns_per_read(objects, in_order),
    )


def _best_ns_per_read(objects: list[int], order: list[int]) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        total = 0
        for index in order:
            total += objects[index]
        best = min(best, time.perf_counter() - start)
    return best / len(order) * 1e9
