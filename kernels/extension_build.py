"""What the just-in-time builds of the C++ and CUDA kernels share: where they build, and
the stale-lock warning.

Build directories live under ``<root>/<python>_torch<version>/`` with ``<root>`` =
``$KVSERVE_CACHE_DIR/torch_extensions`` when that variable is set, else torch's default
root (``$TORCH_EXTENSIONS_DIR``, or ``~/.cache/torch_extensions``).

NOTE: concurrent builds are safe.  ``torch.utils.cpp_extension._jit_compile`` takes a
``FileBaton`` on ``<build dir>/lock`` (created with ``O_CREAT | O_EXCL``) before it runs
ninja; every other process waits until the lock file is gone and then imports the
finished library.  A process killed mid-build leaves that lock file behind, and later
loads wait on it forever: :func:`warn_if_stale_lock` logs a warning when it finds a lock
file older than ``STALE_LOCK_SECONDS``; delete the file by hand.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "KVSERVE_CACHE_DIR"
# The slowest build (CUDA, several architectures) takes a few minutes; a lock file much
# older than that is stale.
STALE_LOCK_SECONDS = 600


def build_root() -> Path:
    """The directory under which every kvserve extension builds (see the module docstring)."""
    from torch.utils import cpp_extension

    cache_dir = os.environ.get(CACHE_DIR_ENV)
    if cache_dir:
        root = Path(cache_dir).expanduser() / "torch_extensions"
    else:
        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    # NOTE: the tag keeps libraries built against different Pythons or torch
    # versions apart when several environments share one cache directory.
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    return root / tag


def needs_compiling(directory: Path, extension_name: str, sources: Sequence[Path]) -> bool:
    """Whether ninja will compile: no library yet, or a source newer than it."""
    library = directory / f"{extension_name}.so"
    if not library.is_file():
        return True
    built_at = library.stat().st_mtime
    return any(source.stat().st_mtime > built_at for source in sources)


def warn_if_stale_lock(lock_file: Path) -> None:
    """Log a warning when ``lock_file`` is older than ``STALE_LOCK_SECONDS``."""
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
