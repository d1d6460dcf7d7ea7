"""Just-in-time build of the CUDA kernels in ``kernels/csrc/``.

Two pairs of translation units: ``paged_attention_cuda.cu`` and ``layer_ops_cuda.cu`` (the
kernels and their launchers, nvcc, CUDA headers only: attention and cache writes; the layer's
small kernels), and ``paged_attention_cuda_binding.cpp`` and ``layer_ops_binding.cpp`` (their
torch bindings, host compiler; one module).  The extension is compiled once per build directory with
``torch.utils.cpp_extension.load`` (about 15-30 s for one architecture on a few cores);
later processes reuse it, and a second load in the same process returns the module
already imported.

Architectures: ``TORCH_CUDA_ARCH_LIST`` when set (torch reads it, e.g. ``"8.0;9.0"``; a
list without code the current GPU runs is refused before building), else the current
device's compute capability (``sm_90`` on an H100).  The build
directory is ``<root>/<python>_torch<version>/kvserve_paged_attention_cuda_<arch tag>``
(see :mod:`kvserve.kernels.extension_build` for ``<root>``, and for why concurrent builds
from the worker processes of one node are safe): machines with different GPUs that share
a cache directory never load each other's libraries.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
from pathlib import Path
from types import ModuleType

import torch

from kvserve.kernels.extension_build import build_root, load_extension, ninja_on_path

logger = logging.getLogger(__name__)

EXTENSION_NAME = "kvserve_paged_attention_cuda"
CSRC_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    CSRC_DIR / "paged_attention_cuda.cu", CSRC_DIR / "paged_attention_cuda_binding.cpp",
    CSRC_DIR / "layer_ops_cuda.cu", CSRC_DIR / "layer_ops_binding.cpp",
)
HEADERS = (
    CSRC_DIR / "check_message.h", CSRC_DIR / "paged_attention_cuda.h", CSRC_DIR / "paged_attention_kernels.cuh",
    CSRC_DIR / "layer_ops_cuda.h", CSRC_DIR / "layer_ops_kernels.cuh", CSRC_DIR / "layer_ops_binding.h",
)
# -lineinfo maps profiler samples (ncu) to source lines at no run-time cost.
EXTRA_CUDA_CFLAGS = ("-O3", "-lineinfo")
EXTRA_CFLAGS = ("-O3",)
ARCH_LIST_ENV = "TORCH_CUDA_ARCH_LIST"

_lock = threading.Lock()
_outcomes: dict[str, ModuleType | CudaExtensionBuildError] = {}


class CudaExtensionBuildError(RuntimeError):
    """The CUDA kernels could not be compiled or loaded on this machine."""


def load_cuda_extension() -> ModuleType:
    """The compiled extension for the current CUDA device, building it first if needed.

    The outcome, module or failure, is kept for the life of the process (per
    architecture), so only the first call can be slow.  Raises
    :class:`CudaExtensionBuildError` when torch has no CUDA, no device is visible, the
    toolchain (nvcc, a C++ compiler, ninja) is missing, or the build fails.
    """
    check_cuda_runtime()
    arch_flags, arch_tag = cuda_arch_flags()
    with _lock:
        if arch_tag not in _outcomes:
            try:
                _outcomes[arch_tag] = _build_and_load(arch_flags, arch_tag)
            except CudaExtensionBuildError as exc:
                _outcomes[arch_tag] = exc
        outcome = _outcomes[arch_tag]
    if isinstance(outcome, CudaExtensionBuildError):
        raise outcome
    return outcome


def loaded_cuda_extension() -> ModuleType | None:
    """The extension if this process has loaded one already, else ``None``; never builds."""
    with _lock:
        return next((outcome for outcome in _outcomes.values() if isinstance(outcome, ModuleType)), None)


def check_cuda_runtime() -> None:
    """Raise :class:`CudaExtensionBuildError` unless torch has CUDA and sees a device."""
    if torch.version.cuda is None:
        raise CudaExtensionBuildError(f"this torch ({torch.__version__}) was built without CUDA")
    if not torch.cuda.is_available():
        raise CudaExtensionBuildError("no CUDA device is visible")


def check_toolchain() -> None:
    """Raise :class:`CudaExtensionBuildError` naming what is missing to build the kernels."""
    from torch.utils import cpp_extension

    nvcc = Path(cpp_extension.CUDA_HOME or "") / "bin" / "nvcc"
    if cpp_extension.CUDA_HOME is None or not nvcc.is_file():
        raise CudaExtensionBuildError(
            f"nvcc not found (CUDA_HOME={cpp_extension.CUDA_HOME!r}); install the CUDA toolkit or set CUDA_HOME"
        )
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise CudaExtensionBuildError(f"no C++ compiler: {compiler!r} is not on PATH (install g++, or set CXX)")
    if not ninja_on_path():
        raise CudaExtensionBuildError("ninja is not on PATH (pip install ninja)")


def cuda_arch_flags() -> tuple[list[str], str]:
    """The nvcc architecture flags of the build, and the tag that names its directory.

    With ``TORCH_CUDA_ARCH_LIST`` set (and not ``native``) the flags are empty: torch
    reads the variable itself.  Otherwise the build targets the current device only.
    A list that has no code the current device runs raises :class:`CudaExtensionBuildError`.
    NOTE: such a build succeeds and loads, and then every launch fails ("no kernel image
    is available") in the middle of a forward pass.
    """
    arch_list = os.environ.get(ARCH_LIST_ENV, "").strip()
    major, minor = torch.cuda.get_device_capability()
    if arch_list and arch_list != "native":
        if not arch_list_runs_on(arch_list, major, minor):
            raise CudaExtensionBuildError(
                f"{ARCH_LIST_ENV}={arch_list!r} has no code this GPU runs (compute capability {major}.{minor}): "
                f"add {major}.{minor} to it, or unset it to build for this GPU"
            )
        return [], "arch_" + re.sub(r"[^0-9A-Za-z]+", "_", arch_list).strip("_").lower()
    return [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"], f"sm{major}{minor}"


def arch_list_runs_on(arch_list: str, major: int, minor: int) -> bool:
    """Whether a device of compute capability ``major.minor`` runs code built for ``arch_list``.

    Binary code for ``M.m`` runs on devices ``M.m'`` with ``m' >= m`` (``M.ma``, the
    architecture-specific variant, on ``M.m`` only); ``+PTX`` code for ``M.m`` on any
    device at or above it (compiled by the driver).  Entries other than numbers (torch
    also takes names such as ``Hopper``) are left for torch to judge: true.
    """
    for entry in re.split(r"[;\s,]+", arch_list):
        if not entry:
            continue
        parsed = re.fullmatch(r"(?:sm_)?(\d+)\.?(\d)(a?)(\+PTX)?", entry, flags=re.IGNORECASE)
        if parsed is None:
            return True
        entry_major, entry_minor = int(parsed.group(1)), int(parsed.group(2))
        specific, ptx = bool(parsed.group(3)), parsed.group(4) is not None
        if ptx and (entry_major, entry_minor) <= (major, minor):
            return True
        if entry_major == major and (entry_minor == minor or (not specific and entry_minor < minor)):
            return True
    return False


def build_directory(arch_tag: str) -> Path:
    """Where the extension for ``arch_tag`` is built (see the module docstring)."""
    return build_root() / f"{EXTENSION_NAME}_{arch_tag}"


def _build_and_load(arch_flags: list[str], arch_tag: str) -> ModuleType:
    check_toolchain()
    return load_extension(
        build_directory(arch_tag),
        f"{EXTENSION_NAME}_{arch_tag}",
        SOURCES + HEADERS,
        f"the CUDA attention kernels for {arch_tag}",
        CudaExtensionBuildError,
        sources=[str(source) for source in SOURCES],
        extra_cflags=list(EXTRA_CFLAGS),
        extra_cuda_cflags=list(EXTRA_CUDA_CFLAGS) + arch_flags,
        extra_include_paths=[str(CSRC_DIR)],
        with_cuda=True,
    )
