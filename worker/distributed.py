"""The tensor-parallel group of one replica.

Every layer that shards its weights across the ranks of a replica talks to the other
ranks through one :class:`TensorParallelGroup`. With ``world_size == 1`` every collective
is a no-op, so the same model code runs on one device without torch.distributed.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from datetime import timedelta
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from kvserve.worker.host_address import is_loopback

logger = logging.getLogger(__name__)


class TensorParallelGroup:
    """The ranks that hold shards of one model copy.

    ``rank`` is this process's index in ``[0, world_size)``. ``group`` is the
    torch.distributed process group (``None`` means the default group); it is never
    touched when ``world_size == 1``.
    """

    def __init__(
        self, rank: int = 0, world_size: int = 1, group: dist.ProcessGroup | None = None
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.rank = rank
        self.world_size = world_size
        self.group = group

    def __repr__(self) -> str:
        return f"TensorParallelGroup(rank={self.rank}, world_size={self.world_size})"

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks, in place; returns it."""
        if self.world_size == 1:
            return tensor
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s, in place; returns it."""
        if self.world_size == 1:
            return tensor
        dist.broadcast(tensor, src=src, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` (same shape on all ranks) along ``dim``,
        in rank order; returns a new tensor (or ``tensor`` itself when alone)."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        # NOTE: list-based all_gather, because gloo lacks all_gather_into_tensor.
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=dim)


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str | None = None,
    timeout_s: float = 300.0,
) -> TensorParallelGroup:
    """Join the default torch.distributed group and return it as a TensorParallelGroup.

    ``backend`` defaults to NCCL when CUDA is available and gloo otherwise.
    ``init_method`` is a ``tcp://host:port`` or ``file://path`` rendezvous shared by all
    ranks. With ``world_size == 1`` no process group is created.
    """
    if world_size == 1:
        return TensorParallelGroup(rank, world_size)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if init_method.startswith("tcp://"):
            os.environ.update(loopback_interface_settings(urlsplit(init_method).hostname, backend, os.environ))
            store = rendezvous_store(init_method, rank, world_size, timeout)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(
                backend=backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
            )
        logger.info("joined %s group as rank %d of %d", backend, rank, world_size)
    elif (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        raise ValueError(
            f"torch.distributed is already initialized as rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, not rank {rank} of {world_size}"
        )
    return TensorParallelGroup(rank, world_size)


# The variables that choose the interface on which each backend's own connections listen.
_INTERFACE_VARIABLES = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


def loopback_interface_settings(host: str | None, backend: str, environ) -> dict[str, str]:
    """The environment settings that keep ``backend``'s own connections on the loopback interface
    when the ranks meet at a loopback ``host``; none otherwise, or where ``environ`` already chooses.

    Left to themselves, gloo listens on the address of the machine's host name and NCCL on its
    first non-loopback interface, whatever the rendezvous: ranks that meet on 127.0.0.1 (all on one
    machine) would accept connections from the network.
    """
    variable = _INTERFACE_VARIABLES[backend]
    if variable in environ or not host or not is_loopback(host):
        return {}
    names = [name for _, name in socket.if_nameindex() if re.fullmatch(r"lo\d*", name)]
    if not names:
        return {}
    # NOTE: NCCL reads a bare name as a prefix of interface names; '=' asks for that one only.
    return {variable: names[0] if backend == "gloo" else f"={names[0]}"}


def rendezvous_store(init_method: str, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The key-value store through which the ranks of ``init_method`` (``tcp://host:port``) find
    each other: rank 0 serves it on ``host:port``, the others connect to it.

    Rank 0 listens on ``host`` only.  torch's own ``tcp://`` rendezvous listens on every interface
    whatever the host, which put an unauthenticated store on the network of a server that
    serves 127.0.0.1 only; its listening socket is therefore bound here and handed to the store.
    """
    address = urlsplit(init_method)
    host, port = address.hostname, address.port
    if not host or port is None:
        raise ValueError(f"a tcp:// rendezvous needs a host and a port, got {init_method!r}")
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(world_size)
    except OSError:
        listener.close()
        raise
    # NOTE: the store serves on the socket from here on: the fd is its, not this object's (which would
    # close it when collected).
    return dist.TCPStore(
        host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=listener.detach()
    )
