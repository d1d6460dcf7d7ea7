"""The worker's block table, mirrored on the device and updated by the plan's differences.

The host table (``InputBatch.block_table``, a row per running request) changes each
step only where a plan hands a request new blocks.  The mirror receives the same
scatter (a few (row, column, block id) triples through pinned memory), so a step's
block tables are a gather of rows on the device rather than a copy of every
request's whole table from the host.  Its width is fixed at the longest sequence the
scheduler sends, so that a CUDA graph may read it with a fixed row stride.
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.kernels.host_to_device import to_device


class DeviceBlockTable:
    """``table[row, column]`` on the device: int32 block ids, ``num_columns`` per row."""

    def __init__(self, num_rows: int, num_columns: int, device: torch.device) -> None:
        if num_rows < 1 or num_columns < 1:
            raise ValueError(f"a block table needs at least one row and column, got {num_rows} x {num_columns}")
        self.device = device
        self.table = torch.zeros((num_rows, num_columns), dtype=torch.int32, device=device)

    @property
    def num_columns(self) -> int:
        return self.table.shape[1]

    def write(self, rows: np.ndarray, columns: np.ndarray, block_ids: np.ndarray) -> None:
        """``table[rows[i], columns[i]] = block_ids[i]`` for every ``i``."""
        if rows.size == 0:
            return
        if int(columns.max()) >= self.num_columns:
            raise ValueError(
                f"a request holds more than {self.num_columns} blocks, more than its longest sequence needs"
            )
        needed_rows = int(rows.max()) + 1
        if needed_rows > self.table.shape[0]:
            self._grow_rows(needed_rows)
        indices = to_device(np.stack([rows, columns]).astype(np.int64, copy=False), self.device)
        values = to_device(np.asarray(block_ids, dtype=np.int32), self.device)
        self.table.index_put_((indices[0], indices[1]), values)

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows ``rows`` (an int64 device tensor) of the table, into ``out`` when given."""
        if out is None:
            return self.table.index_select(0, rows)
        return torch.index_select(self.table, 0, rows, out=out)

    def _grow_rows(self, min_rows: int) -> None:
        num_rows = self.table.shape[0]
        while num_rows < min_rows:
            num_rows *= 2
        grown = torch.zeros((num_rows, self.num_columns), dtype=torch.int32, device=self.device)
        grown[: self.table.shape[0]] = self.table
        self.table = grown
