"""Linear layers with tensor parallelism built in.

Each parameter carries ``weight_loader(param, loaded, shard_id=None)``. ``loaded`` is a
full checkpoint tensor or a safetensors slice (``safe_open(...).get_slice(name)``); the
loader narrows it to this rank's shard before reading, so a rank reads only its bytes.

Sharding (``tp`` = tensor-parallel size, ``r`` = this rank)::

    ColumnParallelLinear   W [out, in]  -> rows    [r*out/tp, (r+1)*out/tp)   no comm
    RowParallelLinear      W [out, in]  -> columns [r*in/tp, (r+1)*in/tp)     all-reduce
    MergedColumnParallel   [gate; up]   -> each part column-sharded, then stacked
    QKVParallelLinear      [q; k; v]    -> q by heads; k, v by KV heads (replicated
                                           when tp > num_kv_heads)
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.worker.distributed import TensorParallelGroup


class WeightSlice(Protocol):
    """A lazily read checkpoint tensor: safetensors' ``PySafeSlice``."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


LoadedWeight = torch.Tensor | WeightSlice


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``; ValueError naming ``what`` when it does not divide."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) must be divisible by {denominator}")
    return numerator // denominator


def kv_head_partition(num_kv_heads: int, tp: TensorParallelGroup) -> tuple[int, int]:
    """This rank's ``(num_local_kv_heads, first_kv_head)``.

    With ``tp.world_size > num_kv_heads`` each rank holds one KV head, replicated:
    rank ``r`` uses KV head ``r * num_kv_heads // world_size``.
    """
    if tp.world_size >= num_kv_heads:
        divide(tp.world_size, num_kv_heads, "tensor-parallel size (replicated KV heads)")
        return 1, tp.rank * num_kv_heads // tp.world_size
    num_local = divide(num_kv_heads, tp.world_size, "num_key_value_heads")
    return num_local, tp.rank * num_local


def weight_shape(loaded: LoadedWeight) -> tuple[int, ...]:
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def narrow_weight(loaded: LoadedWeight, dim: int, start: int, length: int) -> torch.Tensor:
    """Read ``loaded[..., start:start+length, ...]`` along ``dim`` as a tensor."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = [slice(None)] * len(weight_shape(loaded))
    index[dim] = slice(start, start + length)
    return loaded[tuple(index)]


def narrow_shard(
    loaded: LoadedWeight, dim: int, start: int, length: int, full_size: int, name: str = ""
) -> torch.Tensor:
    """``narrow_weight``, once the checkpoint's size along ``dim`` is checked to be the unsharded ``full_size``.

    NOTE: without the check, a config that disagrees with the checkpoint
    (another head_dim, intermediate_size or head count) loaded the first
    rows of each tensor and generated garbage; transformers refuses it.
    """
    shape = weight_shape(loaded)
    if len(shape) <= dim or shape[dim] != full_size:
        raise ValueError(
            f"{name + ': ' if name else ''}the checkpoint's shape {shape} does not have the {full_size} "
            f"along dimension {dim} that the model's config asks for"
        )
    return narrow_weight(loaded, dim, start, length)


def read_weight(loaded: LoadedWeight) -> torch.Tensor:
    """The whole of ``loaded`` as a tensor."""
    if isinstance(loaded, torch.Tensor):
        return loaded
    return loaded[tuple(slice(None) for _ in weight_shape(loaded))]


def copy_weight(dst: torch.Tensor, src: torch.Tensor, name: str = "weight") -> None:
    """Copy ``src`` into ``dst`` (casting dtype/device); ValueError on a shape mismatch."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.data.copy_(src)


def default_weight_loader(
    param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None
) -> None:
    """Loader of an unsharded parameter: copies the whole checkpoint tensor."""
    if shard_id is not None:
        raise ValueError(f"unsharded parameter got shard_id {shard_id!r}")
    copy_weight(param, read_weight(loaded))


def new_parameter(*shape: int, weight_loader: Any = default_weight_loader) -> nn.Parameter:
    """An uninitialised inference parameter carrying ``weight_loader``."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = weight_loader
    return param


class _Linear(nn.Module):
    """``y = x W^T + b`` with weight ``[output_size, input_size]`` (local sizes)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallelGroup):
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size = output_size
        self.weight = new_parameter(output_size, input_size, weight_loader=self.weight_loader)
        self.bias = new_parameter(output_size, weight_loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
        default_weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ReplicatedLinear(_Linear):
    """The full linear layer on every rank."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp: TensorParallelGroup | None = None
    ) -> None:
        super().__init__(input_size, output_size, bias, tp or TensorParallelGroup())


class ColumnParallelLinear(_Linear):
    """Output features split across ranks; each rank returns its slice of the output."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallelGroup) -> None:
        super().__init__(input_size, divide(output_size, tp.world_size, "output_size"), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"ColumnParallelLinear got shard_id {shard_id!r}")
        size = param.shape[0]
        full = size * self.tp.world_size
        copy_weight(param, narrow_shard(loaded, 0, self.tp.rank * size, size, full))


class MergedColumnParallelLinear(_Linear):
    """Several column-parallel projections of the same input stacked in one matmul
    (gate and up of the MLP). ``shard_id`` is the index into ``output_sizes``."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool, tp: TensorParallelGroup
    ) -> None:
        self.local_sizes = [divide(size, tp.world_size, "output_size") for size in output_sizes]
        super().__init__(input_size, sum(self.local_sizes), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.local_sizes):
            raise ValueError(f"shard_id must be in [0, {len(self.local_sizes)}), got {shard_id!r}")
        size = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        shard = narrow_shard(loaded, 0, self.tp.rank * size, size, size * self.tp.world_size, f"shard {shard_id}")
        copy_weight(param.data.narrow(0, offset, size), shard, f"shard {shard_id}")


class QKVParallelLinear(_Linear):
    """Q, K and V projections in one matmul; output ``[q_local | k_local | v_local]``.

    Q is split by heads (``num_heads`` must divide by the TP size); K and V by KV heads,
    replicated when the TP size exceeds ``num_kv_heads`` (see :func:`kv_head_partition`).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TensorParallelGroup,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_local_heads = divide(num_heads, tp.world_size, "num_attention_heads")
        self.num_local_kv_heads, self.first_kv_head = kv_head_partition(num_kv_heads, tp)
        self.q_size = self.num_local_heads * head_dim
        self.kv_size = self.num_local_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
        if shard_id == "q":
            offset, start, size = 0, self.tp.rank * self.q_size, self.q_size
            full = self.num_heads * self.head_dim
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            start, size = self.first_kv_head * self.head_dim, self.kv_size
            full = self.num_kv_heads * self.head_dim
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        shard = narrow_shard(loaded, 0, start, size, full, f"shard {shard_id}")
        copy_weight(param.data.narrow(0, offset, size), shard, f"shard {shard_id}")


class RowParallelLinear(_Linear):
    """Input features split across ranks; partial outputs are summed with an all-reduce.

    The input must be this rank's slice of the features (the output of a column-parallel
    layer). The bias is replicated and added once, after the all-reduce.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallelGroup) -> None:
        super().__init__(divide(input_size, tp.world_size, "input_size"), output_size, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear got shard_id {shard_id!r}")
        if param.dim() == 1:  # bias: replicated
            copy_weight(param, read_weight(loaded), "bias")
            return
        size = param.shape[1]
        full = size * self.tp.world_size
        copy_weight(param, narrow_shard(loaded, 1, self.tp.rank * size, size, full))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias
