"""Host arrays to the device without stalling the GPU's queue.

A copy from pageable host memory makes the host wait for the device's stream
(CUDA stages it through a driver buffer), so each ``torch.from_numpy(x).to("cuda")``
of a step's inputs was a synchronisation.  Copies from pinned (page-locked) memory
with ``non_blocking=True`` are queued on the stream like a kernel.  torch's caching
host allocator keeps a pinned buffer alive until the copies queued from it are done,
so the host array may be dropped at once.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """``array`` as a tensor on ``device``: through pinned memory, without a sync, on CUDA."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def list_to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A Python list as a 1-D tensor on ``device`` (see :func:`to_device`)."""
    tensor = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
