"""Decode steps replayed from CUDA graphs captured at start-up.

A decode step of a small model is a few hundred short kernels; launched one by
one from Python, their launch cost exceeds their run time.  A CUDA graph records
the whole forward pass once and replays it with one launch.  A graph replays on
the same memory it was captured on, so its inputs live in static buffers, a row
per request, written in place before each replay::

    batch of 5 requests, padded to the captured size 8:
    row          0  1  2  3  4 | 5  6  7      (padding rows)
    input_ids    t  t  t  t  t | 0  0  0
    positions    p  p  p  p  p | 0  0  0
    slot_mapping s  s  s  s  s | -1 -1 -1     (the cache write skips slot -1)
    seq_lens     L  L  L  L  L | 1  1  1      (read one key of block table row 0...)
    block_tables gathered rows | row 0        (...a real block, read and never written)

Graphs are captured for the batch sizes of :func:`graph_batch_sizes`, largest
first, sharing one memory pool.  A step whose requests each have one new token,
no more of them than the largest size and no context longer than
``max_seq_len`` replays the graph of the smallest size that holds it; any other
step runs eagerly.  The attention kernels' split plan is fixed at capture for
contexts up to ``max_seq_len``; each replay cuts every request's real context
evenly into the captured split count (``AttentionMetadata.captured``), so a step of
short contexts keeps as many CTAs busy as an eager launch planned for it.
Logits and sampling run after the replay, outside the graph.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvserve.kernels import AttentionMetadata
from kvserve.worker.device_block_table import DeviceBlockTable
from kvserve.worker.input_batch import DecodeBatch

logger = logging.getLogger(__name__)

# The longest context a captured graph serves, as vLLM's max_seq_len_to_capture: the
# split plan baked into a graph has ceil(max_seq_len / split) splits per request.
DEFAULT_MAX_SEQ_LEN_TO_CAPTURE = 8192
_PADDING_SLOT = -1

ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, then multiples of 8 up to ``max_num_seqs`` rounded up to 8."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [size for size in (1, 2, 4) if size < max_num_seqs]
    if max_num_seqs <= 4:
        return (*sizes, next(size for size in (1, 2, 4) if size >= max_num_seqs))
    return (*sizes, *range(8, -(-max_num_seqs // 8) * 8 + 1, 8))


def padded_batch_size(num_reqs: int, batch_sizes: Sequence[int]) -> int | None:
    """The smallest of ``batch_sizes`` (ascending) that holds ``num_reqs``, or ``None``."""
    index = bisect.bisect_left(batch_sizes, num_reqs)
    return batch_sizes[index] if index < len(batch_sizes) else None


class DecodeGraphs:
    """Static input buffers, and a captured graph of ``forward`` per padded batch size.

    ``forward(input_ids, positions, attn_metadata) -> hidden_states`` is the model's
    forward pass over the worker's KV cache.  ``block_table`` is the device mirror
    of the worker's block table, whose rows the steps gather.
    """

    def __init__(
        self,
        forward: ForwardFn,
        block_table: DeviceBlockTable,
        *,
        batch_sizes: Sequence[int],
        max_seq_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        if not batch_sizes or list(batch_sizes) != sorted(set(batch_sizes)) or batch_sizes[0] < 1:
            raise ValueError(f"batch_sizes must be distinct positive sizes in ascending order, got {batch_sizes}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        self.forward = forward
        self.block_table = block_table
        self.batch_sizes = tuple(batch_sizes)
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.device = device
        size = self.batch_sizes[-1]
        pin = device.type == "cuda"
        # Host staging (pinned on CUDA): int64 rows are input_ids, positions, slot_mapping, block-table rows.
        self._host_int64 = torch.zeros((4, size), dtype=torch.int64, pin_memory=pin)
        self._host_seq_lens = torch.zeros(size, dtype=torch.int32, pin_memory=pin)
        self._device_int64 = torch.zeros((4, size), dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.rows = self._device_int64.unbind(0)
        self.seq_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((size, block_table.num_columns), dtype=torch.int32, device=device)
        self._copied: torch.cuda.Event | None = None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def padded_size(self, batch: DecodeBatch) -> int | None:
        """The captured size that ``batch`` replays, or ``None`` when it runs eagerly."""
        if batch.max_seq_len > self.max_seq_len:
            return None
        size = padded_batch_size(batch.num_reqs, self.batch_sizes)
        return size if size in self._graphs else None

    def load(self, batch: DecodeBatch, padded_size: int) -> None:
        """Write ``batch`` into rows ``[0, n)`` of the static buffers and padding into ``[n, padded_size)``."""
        num_reqs = batch.num_reqs
        if not num_reqs <= padded_size <= self.batch_sizes[-1]:
            raise ValueError(f"cannot pad {num_reqs} requests to {padded_size} (largest size {self.batch_sizes[-1]})")
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have read the staging buffers
        host = self._host_int64.numpy()
        host[0, :num_reqs] = batch.input_ids
        host[1, :num_reqs] = batch.positions
        host[2, :num_reqs] = batch.slot_mapping
        host[3, :num_reqs] = batch.rows
        host[:, num_reqs:padded_size] = 0
        host[2, num_reqs:padded_size] = _PADDING_SLOT
        seq_lens = self._host_seq_lens.numpy()
        seq_lens[:num_reqs] = batch.seq_lens
        seq_lens[num_reqs:padded_size] = 1
        non_blocking = self.device.type == "cuda"
        self._device_int64[:, :padded_size].copy_(self._host_int64[:, :padded_size], non_blocking=non_blocking)
        self.seq_lens[:padded_size].copy_(self._host_seq_lens[:padded_size], non_blocking=non_blocking)
        self.block_table.gather(self.rows[:padded_size], out=self.block_tables[:padded_size])
        if non_blocking:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def metadata(self, padded_size: int, seq_lens: Sequence[int] | None = None) -> AttentionMetadata:
        """Attention metadata over the first ``padded_size`` rows of the static buffers.

        Its host copies (from which kernels plan their launch) describe ``seq_lens``,
        or, for a capture, every row at ``max_seq_len`` (``captured``: upper bounds).
        """
        host_seq_lens = tuple(seq_lens) if seq_lens is not None else (self.max_seq_len,) * padded_size
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: padded_size + 1],
            seq_lens=self.seq_lens[:padded_size],
            block_tables=self.block_tables[:padded_size],
            slot_mapping=self.slot_mapping[:padded_size],
            query_start_loc_cpu=tuple(range(padded_size + 1)),
            seq_lens_cpu=host_seq_lens,
            max_query_len=1,
            max_seq_len=max(host_seq_lens),
            captured=seq_lens is None,
        )

    def capture(self) -> float:
        """Capture a graph for every batch size, largest first; returns the seconds it took."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        start = time.perf_counter()
        self._pool = torch.cuda.graph_pool_handle()
        # NOTE: captured on a side stream with capture_begin/capture_end rather than under
        # torch.cuda.graph, which runs a full gc.collect() before each capture: 35 of them
        # took seconds in a process holding many Python objects.
        stream = torch.cuda.Stream(self.device)
        for size in reversed(self.batch_sizes):
            empty = DecodeBatch(
                input_ids=np.zeros(0, np.int64), positions=np.zeros(0, np.int64),
                slot_mapping=np.zeros(0, np.int64), seq_lens=np.zeros(0, np.int32), rows=np.zeros(0, np.int64),
                logits_indices=np.zeros(0, np.int64), sampling_params=[], output_indices=[],
            )
            self.load(empty, size)  # every row a padding row: nothing is written to the cache
            metadata = self.metadata(size)
            self.forward(self.input_ids[:size], self.positions[:size], metadata)  # warm-up: cuBLAS, workspaces
            stream.wait_stream(torch.cuda.current_stream(self.device))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=self._pool)
                try:
                    output = self.forward(self.input_ids[:size], self.positions[:size], metadata)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self._graphs[size] = (graph, output)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def run(
        self,
        batch: DecodeBatch,
        padded_size: int,
        fix_input_ids: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Replay the graph of ``padded_size`` on ``batch``; returns its hidden states ``[n, hidden]``.

        ``fix_input_ids`` may rewrite the loaded token ids in place before the replay
        (placeholders of overlapped scheduling).
        """
        graph, output = self._graphs[padded_size]
        self.load(batch, padded_size)
        if fix_input_ids is not None:
            fix_input_ids(self.input_ids[: batch.num_reqs])
        graph.replay()
        return output[: batch.num_reqs]

    def release(self) -> None:
        """Drop the graphs and their memory pool."""
        self._graphs.clear()
        self._pool = None
