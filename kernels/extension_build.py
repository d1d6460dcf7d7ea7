"""What the just-in-time builds of the C++ and CUDA kernels share: where they build, and
how one build at a time runs in a build directory.

Build directories live under ``<root>/<python>_torch<version>/`` with ``<root>`` =
``$KVSERVE_CACHE_DIR/torch_extensions`` when that variable is set, else torch's default
root (``$TORCH_EXTENSIONS_DIR``, or ``~/.cache/torch_extensions``).

NOTE: concurrent builds are safe.  :func:`load_extension` holds an ``flock`` on
``<build dir>/kvserve.flock`` while it runs ``torch.utils.cpp_extension.load``: the
worker processes of one node build one at a time, and the later ones only import the
finished library.  The kernel releases an ``flock`` when its holder dies, so a process
killed mid-build cannot block the others.  torch takes its own lock inside (a ``lock``
file created with ``O_CREAT | O_EXCL``, which it waits on forever); a killed build
leaves that file behind, and the next holder of the ``flock`` removes it: only a
kvserve load under the ``flock`` could have made it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "KVSERVE_CACHE_DIR"


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


def ninja_on_path() -> bool:
    """Whether ``ninja`` runs from PATH, once this Python's scripts directory is on it.

    NOTE: ``pip install ninja`` puts ninja in the environment's scripts directory
    (``.venv/bin``), which is on PATH only while the environment is activated.
    Started as ``.venv/bin/kvserve serve`` (by a service manager, a container's
    entry point), the build found no ninja, or one that does not run (a pyenv
    shim for another Python), and every worker fell back to the slow torch
    attention.  torch's build runs ``ninja --version`` through PATH, so this
    does too, and when it fails puts the directory first, as activating would.
    """
    if _ninja_runs():
        return True
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja", path=scripts) is None:
        return False
    os.environ["PATH"] = os.pathsep.join(filter(None, (scripts, os.environ.get("PATH"))))
    return _ninja_runs()


def _ninja_runs() -> bool:
    try:
        subprocess.run(["ninja", "--version"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return False
    return True


def needs_compiling(directory: Path, extension_name: str, sources: Sequence[Path]) -> bool:
    """Whether ninja will compile: no library yet, or a source newer than it."""
    library = directory / f"{extension_name}.so"
    if not library.is_file():
        return True
    built_at = library.stat().st_mtime
    return any(source.stat().st_mtime > built_at for source in sources)


def load_extension(
    directory: Path,
    name: str,
    watched: Sequence[Path],
    what: str,
    error: type[Exception],
    **load_args: Any,
) -> ModuleType:
    """``torch.utils.cpp_extension.load`` of extension ``name`` in ``directory``, one process at a time.

    ``watched``: its sources and headers (a change to one rebuilds it; logged first, as a
    build takes a while).  Any failure, from creating the directory to importing the
    library, is raised as ``error`` naming ``what`` and the directory.
    """
    from torch.utils import cpp_extension

    try:
        with exclusive_build(directory):
            if needs_compiling(directory, name, watched):
                logger.info("building %s in %s (once per build directory)", what, directory)
            return cpp_extension.load(name=name, build_directory=str(directory), verbose=False, **load_args)
    except (RuntimeError, OSError, ImportError, ValueError, subprocess.CalledProcessError) as exc:
        raise error(f"building {what} in {directory} failed: {exc}") from exc


@contextlib.contextmanager
def exclusive_build(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s build lock (see the module docstring), creating the directory first.

    Waits, saying so once, while another process holds it.  A torch ``lock`` file found
    under the lock is a killed build's: it is removed, with a warning.
    """
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "kvserve.flock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process's build in %s", directory)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            leftover = directory / "lock"
            if leftover.exists():
                logger.warning("removing %s, left by a build that was killed", leftover)
                leftover.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
