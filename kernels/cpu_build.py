"""Just-in-time build of the C++ CPU kernels in ``kernels/csrc/``.

The extension is compiled once per build directory (10-30 s on 2 cores) with
``torch.utils.cpp_extension.load``; later processes reuse it: a warm load only
reruns ninja, which finds nothing to do (about 0.1 s), and a second load in the
same process returns the module already imported.

Build directory: ``<root>/<python>_torch<version>/kvserve_paged_attention_cpu``
with ``<root>`` = ``$KVSERVE_CACHE_DIR/torch_extensions`` when that variable is
set, else torch's default root (``$TORCH_EXTENSIONS_DIR``, or
``~/.cache/torch_extensions``).

NOTE: concurrent builds are safe.  ``torch.utils.cpp_extension._jit_compile``
takes a ``FileBaton`` on ``<build dir>/lock`` (created with ``O_CREAT | O_EXCL``)
before it runs ninja; every other process waits until the lock file is gone and
then imports the finished library.  A process killed mid-build leaves that lock
file behind, and later loads wait on it forever: a load logs a warning when it
finds a lock file older than ``STALE_LOCK_SECONDS``; delete the file by hand.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "KVSERVE_CACHE_DIR"
EXTENSION_NAME = "kvserve_paged_attention_cpu"
SOURCES = (Path(__file__).resolve().parent / "csrc" / "paged_attention_cpu.cpp",)
# NOTE: no -march=native: the build directory may be shared by machines with
# different CPUs, and a library built for one would crash on another.
# -fopenmp turns at::parallel_for (inlined from ATen's headers) parallel; it
# links the libgomp.so.1 that torch has already loaded.
EXTRA_CFLAGS = ("-O3", "-fopenmp")
EXTRA_LDFLAGS = ("-fopenmp",)

# A build takes 10-30 s; a lock file much older than that is stale.
STALE_LOCK_SECONDS = 600

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
    from torch.utils import cpp_extension

    cache_dir = os.environ.get(CACHE_DIR_ENV)
    if cache_dir:
        root = Path(cache_dir).expanduser() / "torch_extensions"
    else:
        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    # NOTE: the tag keeps libraries built against different Pythons or torch
    # versions apart when several environments share one cache directory.
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    return root / tag / EXTENSION_NAME


def check_toolchain() -> None:
    """Raise :class:`CpuExtensionBuildError` naming what is missing to build the kernels."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise CpuExtensionBuildError(
            f"no C++ compiler: {compiler!r} is not on PATH (install g++, or set CXX)"
        )
    if shutil.which("ninja") is None:
        raise CpuExtensionBuildError("ninja is not on PATH (pip install ninja)")


def _build_and_load() -> ModuleType:
    check_toolchain()
    from torch.utils import cpp_extension

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    _warn_if_stale_lock(directory / "lock")
    if _needs_compiling(directory):
        logger.info("building the C++ CPU attention kernels in %s (once per build directory; 10-30 s)", directory)
    try:
        return cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(source) for source in SOURCES],
            extra_cflags=list(EXTRA_CFLAGS),
            extra_ldflags=list(EXTRA_LDFLAGS),
            build_directory=str(directory),
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as exc:
        raise CpuExtensionBuildError(
            f"building the C++ CPU attention kernels in {directory} failed: {exc}"
        ) from exc


def _needs_compiling(directory: Path) -> bool:
    """Whether ninja will compile: no library yet, or a source newer than it."""
    library = directory / f"{EXTENSION_NAME}.so"
    if not library.is_file():
        return True
    built_at = library.stat().st_mtime
    return any(source.stat().st_mtime > built_at for source in SOURCES)


def _warn_if_stale_lock(lock_file: Path) -> None:
    try:
        age = time.time() - lock_file.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        logger.warning(
            "%s is %.0f s old: a build was probably killed, and this load will wait for it forever; "
            "delete the file if no build is running",
            lock_file,
            age,
        )
