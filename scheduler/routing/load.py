"""Replica loads as policies read them: one record per replica, stored as columns.

A router reads the load of every replica on every request.  With a thousand
replicas, building a thousand records per request costs more than routing,
so the router keeps a ``LoadTable``: numpy columns updated in O(1) when one
replica's load changes, which policies scan with vectorised operations.  It
is also a ``Sequence[ReplicaLoad]``, and a plain list of ``ReplicaLoad`` (as
tests build by hand) converts with ``LoadTable.of``.

A replica may be unavailable (failed, or not started yet): its row stays, so
that ids keep their meaning, and policies never choose it.

Contract: ``replicas[i].replica_id == i``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, overload

import numpy as np


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What a policy knows of one replica's load.

    ``num_queued_prefill_tokens``: prompt tokens admitted but not computed yet
    (waiting requests, and running ones still in their prompt), of which
    ``num_queued_cached_tokens`` were in the prefix cache when queued.
    ``num_running_tokens``: KV context of the running requests.
    ``num_inflight_prefill_tokens``: prompt tokens the step in flight computes.
    The two figures of the queue's cache and the step in flight come from the
    router's ``QueueTracker``, the others from ``Scheduler.get_load()``.
    ``available``: whether the replica may be chosen at all.
    """

    replica_id: int
    num_running: int = 0
    num_waiting: int = 0
    num_queued_prefill_tokens: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_running_tokens: int = 0
    num_queued_cached_tokens: int = 0
    num_inflight_prefill_tokens: int = 0
    available: bool = True

    @property
    def num_outstanding(self) -> int:
        """Requests on the replica, running or waiting."""
        return self.num_running + self.num_waiting


class NoAvailableReplicaError(RuntimeError):
    """Every replica is unavailable: no policy can choose one."""


class LoadSnapshot(Protocol):
    """Anything with a replica's load fields as its scheduler counts them (``SchedulerLoad``, ``ReplicaLoad``)."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_queued_prefill_tokens(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_total_blocks(self) -> int: ...
    @property
    def num_running_tokens(self) -> int: ...


_COLUMNS = (
    "num_running",
    "num_waiting",
    "num_outstanding",
    "num_queued_prefill_tokens",
    "num_free_blocks",
    "num_total_blocks",
    "num_running_tokens",
    "num_queued_cached_tokens",
    "num_inflight_prefill_tokens",
)


class LoadTable(Sequence[ReplicaLoad]):
    """The loads of replicas ``0..n-1`` as int64 columns, updated one replica at a time.

    NOTE: one row per replica in a single 2-D array, so that recording a
    replica's load (after every step of every replica) is one numpy call;
    the column properties are views into it.  Availability is a separate
    boolean column, changed only by ``set_available`` (a load snapshot does
    not carry it); every replica starts available.
    """

    __slots__ = ("_rows", "_available", "available_outstanding", "num_available")

    def __init__(self, num_replicas: int) -> None:
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive integer, got {num_replicas!r}")
        self._rows = np.zeros((num_replicas, len(_COLUMNS)), dtype=np.int64)
        # Sum of the available replicas' num_outstanding, kept so that their mean load is O(1).
        self.available_outstanding = 0
        self._available = np.ones(num_replicas, dtype=bool)
        self.num_available = num_replicas

    @classmethod
    def of(cls, replicas: Sequence[ReplicaLoad]) -> LoadTable:
        """``replicas`` itself if it is a table, else a new table holding them."""
        if isinstance(replicas, LoadTable):
            return replicas
        if not replicas:
            raise ValueError("a policy needs at least one replica")
        table = cls(len(replicas))
        for position, load in enumerate(replicas):
            if load.replica_id != position:
                raise ValueError(
                    f"replicas[{position}] has replica_id {load.replica_id}: ids must be 0..n-1 in order"
                )
            table.set(position, load, load.num_queued_cached_tokens, load.num_inflight_prefill_tokens)
            if not load.available:
                table.set_available(position, False)
        return table

    def set(
        self,
        replica_id: int,
        load: LoadSnapshot,
        num_queued_cached_tokens: int = 0,
        num_inflight_prefill_tokens: int = 0,
    ) -> None:
        """Record ``replica_id``'s current load, with the router's figures of its queue (``QueueTracker``)."""
        rows = self._rows
        outstanding = load.num_running + load.num_waiting
        if self._available[replica_id]:
            self.available_outstanding += outstanding - int(rows[replica_id, 2])
        rows[replica_id] = (
            load.num_running,
            load.num_waiting,
            outstanding,
            load.num_queued_prefill_tokens,
            load.num_free_blocks,
            load.num_total_blocks,
            load.num_running_tokens,
            num_queued_cached_tokens,
            num_inflight_prefill_tokens,
        )

    def set_available(self, replica_id: int, available: bool) -> None:
        """Whether policies may choose ``replica_id``; its load row is kept either way."""
        if not 0 <= replica_id < len(self._rows):
            raise IndexError(f"replica {replica_id} out of range")
        available = bool(available)
        if self._available[replica_id] != available:
            self._available[replica_id] = available
            sign = 1 if available else -1
            self.num_available += sign
            self.available_outstanding += sign * int(self._rows[replica_id, 2])

    @property
    def available(self) -> np.ndarray:
        """Whether each replica may be chosen (bool; read it, never write it)."""
        return self._available

    @property
    def all_available(self) -> bool:
        return self.num_available == len(self._rows)

    def available_ids(self) -> np.ndarray:
        """The available replicas' ids, ascending; ``NoAvailableReplicaError`` if there are none."""
        self.check_any_available()
        return np.flatnonzero(self._available)

    def check_any_available(self) -> None:
        """Raise ``NoAvailableReplicaError`` unless some replica is available."""
        if not self.num_available:
            raise NoAvailableReplicaError(f"none of the {len(self._rows)} replicas is available")

    @property
    def num_running(self) -> np.ndarray:
        return self._rows[:, 0]

    @property
    def num_waiting(self) -> np.ndarray:
        return self._rows[:, 1]

    @property
    def num_outstanding(self) -> np.ndarray:
        """Running plus waiting requests of each replica."""
        return self._rows[:, 2]

    @property
    def num_queued_prefill_tokens(self) -> np.ndarray:
        return self._rows[:, 3]

    @property
    def num_free_blocks(self) -> np.ndarray:
        return self._rows[:, 4]

    @property
    def num_total_blocks(self) -> np.ndarray:
        return self._rows[:, 5]

    @property
    def num_running_tokens(self) -> np.ndarray:
        return self._rows[:, 6]

    @property
    def num_queued_cached_tokens(self) -> np.ndarray:
        return self._rows[:, 7]

    @property
    def num_inflight_prefill_tokens(self) -> np.ndarray:
        return self._rows[:, 8]

    def bounded_load(self, load_factor: float) -> float:
        """``load_factor`` x the mean outstanding requests of the available replicas, one more counted.

        The bound of consistent hashing with bounded loads, for the request
        being placed; unavailable replicas' requests (a draining replica's)
        count for nothing, as they cannot move.
        """
        return load_factor * (self.available_outstanding + 1) / self.num_available

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> ReplicaLoad: ...
    @overload
    def __getitem__(self, index: slice) -> list[ReplicaLoad]: ...

    def __getitem__(self, index: int | slice) -> ReplicaLoad | list[ReplicaLoad]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"replica {index} out of range")
        row = self._rows[index].tolist()
        return ReplicaLoad(
            replica_id=index,
            num_running=row[0],
            num_waiting=row[1],
            num_queued_prefill_tokens=row[3],
            num_free_blocks=row[4],
            num_total_blocks=row[5],
            num_running_tokens=row[6],
            num_queued_cached_tokens=row[7],
            num_inflight_prefill_tokens=row[8],
            available=bool(self._available[index]),
        )
