"""Just-in-time build of the C++ CPU kernels in ``kernels/csrc/``.

The extension is compiled once per build directory (10-30 s on 2 cores) with
``torch.utils.cpp_extension.load``; later processes reuse it: a warm load only
reruns ninja, which finds nothing to do (about 0.1 s), and a second load in the
same process returns the module already imported.

Build directory: ``<root>/<python>_torch<version>/kvserve_paged_attention_cpu``
(see :mod:`kvserve.kernels.extension_build` for ``<root>``, and for why concurrent
builds from several processes are safe).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from types import ModuleType

from kvserve.kernels.extension_build import CACHE_DIR_ENV, build_root, load_extension, ninja_on_path

logger = logging.getLogger(__name__)

__all__ = ["CACHE_DIR_ENV", "CpuExtensionBuildError", "build_directory", "check_toolchain", "load_cpu_extension"]

EXTENSION_NAME = "kvserve_paged_attention_cpu"
CSRC_DIR = Path(__file__).resolve().parent / "csrc"
# The binding (ATen, pybind) and the vector code (no ATen: quick to compile) are
# separate translation units, which ninja compiles in parallel.
SOURCES = tuple(
    CSRC_DIR / name
    for name in ("paged_attention_cpu.cpp", "cpu_attention_plan.cpp", "cpu_row_ops.cpp", "cpu_row_tiles.cpp")
)
HEADERS = tuple(
    CSRC_DIR / name for name in ("check_message.h", "cpu_attention.h", "cpu_attention_plan.h", "cpu_vector_math.h")
)
# NOTE: no -march=native: the build directory may be shared by machines with
# different CPUs, and a library built for one would crash on another.  The vector
# code carries target attributes and is chosen at run time instead.
# -fopenmp turns at::parallel_for (inlined from ATen's headers) parallel; it
# links the libgomp.so.1 that torch has already loaded.
EXTRA_CFLAGS = ("-O3", "-fopenmp")
EXTRA_LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_outcome: ModuleType | CpuExtensionBuildError | None = None


class CpuExtensionBuildError(RuntimeError):
    """The C++ CPU kernels could not be compiled or loaded on this machine."""


def load_cpu_extension() -> ModuleType:
    """The compiled extension module, building it first if needed.

    The outcome, module or failure, is kept for the life of the process, so
    only the first call can be slow.  Raises :class:`CpuExtensionBuildError`
    when the toolchain (a C++ compiler, ninja) is missing or the build fails.
    """
    global _outcome
    with _lock:
        if _outcome is None:
            try:
                _outcome = _build_and_load()
            except CpuExtensionBuildError as exc:
                _outcome = exc
    if isinstance(_outcome, CpuExtensionBuildError):
        raise _outcome
    return _outcome


def build_directory() -> Path:
    """Where the extension is built (see the module docstring)."""
    return build_root() / EXTENSION_NAME


def check_toolchain() -> None:
    """Raise :class:`CpuExtensionBuildError` naming what is missing to build the kernels."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise CpuExtensionBuildError(
            f"no C++ compiler: {compiler!r} is not on PATH (install g++, or set CXX)"
        )
    if not ninja_on_path():
        raise CpuExtensionBuildError("ninja is not on PATH (pip install ninja)")


def _build_and_load() -> ModuleType:
    check_toolchain()
    return load_extension(
        build_directory(),
        EXTENSION_NAME,
        SOURCES + HEADERS,
        "the C++ CPU attention kernels (10-30 s)",
        CpuExtensionBuildError,
        sources=[str(source) for source in SOURCES],
        extra_cflags=list(EXTRA_CFLAGS),
        extra_ldflags=list(EXTRA_LDFLAGS),
    )
