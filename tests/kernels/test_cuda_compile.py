"""The CUDA kernels compile, on machines without a GPU too (CI): nvcc on the kernels'
translation units (attention; the layer's small kernels) for sm_90 and sm_80, and the host
compiler on the torch bindings.

torch's CPU wheel ships most of c10/cuda but not its generated
``c10/cuda/impl/cuda_cmake_macros.h``; the binding check supplies a stand-in for it.
The compilations run in parallel, about 20 s on 2 idle cores (36 attention kernels:
3 dtypes x 2 head_dims x 2 block sizes x tiles of 1, 4 and 8 query rows).
Skipped only where nvcc is absent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch.utils import cpp_extension

CSRC = Path(__file__).resolve().parents[2] / "kernels" / "csrc"
KERNELS_SOURCE = CSRC / "paged_attention_cuda.cu"
LAYER_OPS_SOURCE = CSRC / "layer_ops_cuda.cu"
BINDING_SOURCES = (CSRC / "paged_attention_cuda_binding.cpp", CSRC / "layer_ops_binding.cpp")
ARCHITECTURES = ("90", "80")
# A kernel that indexes a register array at run time moves it to local memory (a stack
# frame); a few bytes are a spilled scalar, more is a regression of the hot loop.
MAX_STACK_FRAME_BYTES = 16
# dtypes x head_dims x block sizes x tiles of 1, 4 and 8 query rows (prefill tiles are the 8-row one).
ATTENTION_INSTANTIATIONS = 3 * 2 * 2 * 3
CUDA_CMAKE_MACROS = "c10/cuda/impl/cuda_cmake_macros.h"


def find_nvcc() -> Path | None:
    on_path = shutil.which("nvcc")
    if on_path:
        return Path(on_path)
    if cpp_extension.CUDA_HOME and (Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc").is_file():
        return Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc"
    return None


NVCC = find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed (no CUDA toolkit on this machine)")


@dataclass(frozen=True, slots=True)
class Compilation:
    command: list[str]
    process: subprocess.Popen

    def wait(self) -> tuple[int, str]:
        output, _ = self.process.communicate(timeout=300)
        return self.process.returncode, output


def torch_include_flags() -> list[str]:
    return [f"-I{path}" for path in cpp_extension.include_paths()]


def start(command: list[str]) -> Compilation:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return Compilation(command, process)


@pytest.fixture(scope="module")
def compilations(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Compilation]]:
    """Every compilation of the file, started together so that they share the cores."""
    tmp = tmp_path_factory.mktemp("cuda_compile")
    started = {}
    for arch in ARCHITECTURES:
        for name, source in (("kernels", KERNELS_SOURCE), ("layer_ops", LAYER_OPS_SOURCE)):
            started[f"{name}_sm_{arch}"] = start(
                [str(NVCC), "-std=c++17", "-O3", "-c", str(source), "-o", str(tmp / f"{name}_sm{arch}.o"),
                 f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v",
                 *cpp_extension.COMMON_NVCC_FLAGS, *torch_include_flags()]
            )
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler):
        started["binding"] = start(binding_command(compiler, tmp))
    yield started
    for compilation in started.values():
        if compilation.process.poll() is None:
            compilation.process.kill()
            compilation.process.wait()


def binding_command(compiler: str, tmp: Path) -> list[str]:
    """Syntax-only compile of the bindings as the GPU build would compile them."""
    include_flags = torch_include_flags()
    if not any((Path(path) / CUDA_CMAKE_MACROS).is_file() for path in cpp_extension.include_paths()):
        stub = tmp / "stub_include" / CUDA_CMAKE_MACROS
        stub.parent.mkdir(parents=True)
        stub.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        include_flags.append(f"-I{tmp / 'stub_include'}")
    return [
        compiler, "-std=c++17", "-fsyntax-only", "-Wall", "-Wno-c++20-extensions",
        "-DTORCH_EXTENSION_NAME=kvserve_compile_check", "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-I{CSRC}", *include_flags, *cuda_include_flags(), f"-I{sysconfig.get_paths()['include']}",
        *map(str, BINDING_SOURCES),
    ]


def cuda_include_flags() -> list[str]:
    """The include flags nvcc itself uses (``nvcc`` may be a wrapper script outside the toolkit)."""
    dryrun = subprocess.run(
        [str(NVCC), "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
        capture_output=True, text=True, check=True,
    )
    match = re.search(r'INCLUDES="([^"]*)"', dryrun.stdout + dryrun.stderr)
    assert match, f"no include directories in nvcc --dryrun output:\n{dryrun.stderr}"
    return match.group(1).split()


def stack_frames(ptxas_output: str) -> dict[str, int]:
    """Stack frame bytes of every kernel in ``ptxas -v`` output, by mangled name."""
    frames, kernel = {}, None
    for line in ptxas_output.splitlines():
        if match := re.search(r"Compiling entry function '(\w+)'", line):
            kernel = match.group(1)
        elif (match := re.search(r"(\d+) bytes stack frame", line)) and kernel is not None:
            frames[kernel] = int(match.group(1))
    return frames


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_kernels_compile_with_nvcc(compilations: dict[str, Compilation], arch: str) -> None:
    returncode, output = compilations[f"kernels_sm_{arch}"].wait()
    assert returncode == 0, f"nvcc failed for sm_{arch}:\n{output[-6000:]}"
    frames = stack_frames(output)
    attention_kernels = [name for name in frames if "paged_attention_kernel" in name]
    assert len(attention_kernels) == ATTENTION_INSTANTIATIONS, output[-3000:]
    assert any("combine_splits_kernel" in name for name in frames)
    assert any("write_kv_cache_kernel" in name for name in frames)
    too_large = {name: size for name, size in frames.items() if size > MAX_STACK_FRAME_BYTES}
    assert not too_large, f"kernels with local-memory stack frames on sm_{arch}: {too_large}"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_layer_ops_compile_with_nvcc(compilations: dict[str, Compilation], arch: str) -> None:
    """Both dtypes of each small kernel, RMSNorm and SiLU-and-mul in 16-byte and 2-byte accesses."""
    returncode, output = compilations[f"layer_ops_sm_{arch}"].wait()
    assert returncode == 0, f"nvcc failed for sm_{arch}:\n{output[-6000:]}"
    frames = stack_frames(output)
    for kernel, count in (("add_rms_norm_kernel", 4), ("rope_and_write_kv_kernel", 2), ("silu_and_mul_kernel", 4)):
        assert sum(kernel in name for name in frames) == count, (kernel, sorted(frames))
    assert all(size == 0 for size in frames.values()), frames


def test_torch_binding_compiles(compilations: dict[str, Compilation]) -> None:
    if "binding" not in compilations:
        pytest.skip(f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} is not on PATH)")
    returncode, output = compilations["binding"].wait()
    assert returncode == 0, f"the torch binding does not compile:\n{output[-6000:]}"
