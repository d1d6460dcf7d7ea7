"""Launching a Triton kernel again without Triton's per-call argument binding.

``kernel[grid](*args)`` binds the arguments to the signature, specialises every one of
them (a pointer's 16-byte alignment, an integer's value 1, divisibility by 16 and width),
builds a cache key from that, looks the compiled kernel up and then launches it.  On the
H200 that was about 45 us per call (profiled) and 129 calls per eager Llama-3-8B step:
the largest host cost of a step that runs without a CUDA graph (``kernels/csrc/NOTES.md``).

:class:`CachedLauncher` keeps the compiled kernel of each specialisation itself.  Its key
is our own, computed from the same facts Triton specialises on, and at least as fine
(two calls with one key always get one Triton specialisation): per tensor its dtype and
whether its data pointer is 16-byte aligned; per integer whether it is 1, whether 16
divides it and which integer type it needs; floats, bools and ``None`` by type (and
``None`` by value); the constexpr keywords by value; the current device.  A miss goes
through ``kernel[grid]`` (which compiles or finds the kernel), a hit launches the
compiled kernel directly through ``CompiledKernel[grid]``.

Only where this was checked: a CUDA tensor first and Triton at least 3.6, whose compiled
kernel takes every bound argument, constexprs included, in signature order, and calls the
launch hooks (a profiler's) as ``kernel[grid]`` does.  Otherwise every call goes through
``kernel[grid]``, as it does under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

_INT32 = (-(2**31), 2**31)
_INT64_MAX = 2**63
MIN_TRITON_VERSION = (3, 6)


@functools.cache
def _triton_version_ok() -> bool:
    import triton

    major_minor = tuple(int(part) for part in triton.__version__.split(".")[:2])
    return major_minor >= MIN_TRITON_VERSION


def argument_key(arg: object) -> object:
    """What Triton specialises a kernel argument on, or finer (see the module docstring)."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool):  # before int: bool is an int
        return bool
    if isinstance(arg, int):
        width = "i32" if _INT32[0] <= arg < _INT32[1] else "u64" if arg >= _INT64_MAX else "i64"
        return (width, arg == 1, arg % 16 == 0)
    if arg is None:
        return None
    if isinstance(arg, float):
        return float
    raise TypeError(f"CachedLauncher: no key for a {type(arg).__name__} argument")


class CachedLauncher:
    """``launcher(grid, *args, **constexprs)`` launches ``kernel`` (a ``triton.jit`` function) as
    ``kernel[grid](*args, **constexprs)`` does, with the compiled kernel looked up by
    :func:`argument_key` instead of by Triton's binder.  Every parameter after the positional
    ``args`` must be given as a keyword."""

    def __init__(self, kernel: Any) -> None:
        self._kernel = kernel
        self._arg_names: list[str] = list(kernel.arg_names)
        self._compiled: dict[tuple, Any] = {}

    @property
    def num_compiled(self) -> int:
        """Compiled kernels kept, one per specialisation met (tests, benchmarks)."""
        return len(self._compiled)

    def __call__(self, grid: Sequence[int], *args: object, **constexprs: object) -> None:
        if not (args and isinstance(args[0], torch.Tensor) and args[0].is_cuda and _triton_version_ok()):
            self._kernel[grid](*args, **constexprs)
            return
        key = (torch.cuda.current_device(), tuple(map(argument_key, args)), tuple(constexprs.items()))
        compiled = self._compiled.get(key)
        if compiled is None:
            if set(constexprs) != set(self._arg_names[len(args):]):
                raise TypeError(f"CachedLauncher: give {self._arg_names[len(args):]} as keywords, got {sorted(constexprs)}")
            compiled = self._kernel[grid](*args, **constexprs)
            if compiled is None or not hasattr(compiled, "packed_metadata"):
                return  # not a compiled kernel (an interpreter): launched above; nothing to keep
            self._compiled[key] = compiled
            return
        grid = tuple(grid) + (1,) * (3 - len(grid))
        compiled[grid](*args, *(constexprs[name] for name in self._arg_names[len(args):]))
