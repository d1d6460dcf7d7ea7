"""One build at a time in a build directory, and build failures as the builders' own errors."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest

from kvserve.kernels import cpu_build
from kvserve.kernels.backend import BACKEND_ENV_VAR, get_attention_backend
from kvserve.kernels.cpu_build import CpuExtensionBuildError
from kvserve.kernels.extension_build import exclusive_build, load_extension


def test_a_second_build_waits_for_the_first(tmp_path: Path) -> None:
    order: list[str] = []
    first_holds, second_started = threading.Event(), threading.Event()

    def first() -> None:
        with exclusive_build(tmp_path):
            first_holds.set()
            second_started.wait(10)
            time.sleep(0.2)  # the second is waiting now
            order.append("first done")

    def second() -> None:
        first_holds.wait(10)
        second_started.set()
        with exclusive_build(tmp_path):
            order.append("second builds")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert order == ["first done", "second builds"]


def test_a_build_killed_mid_way_blocks_nobody_and_its_torch_lock_is_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    holder = (
        "import fcntl, sys, time\n"
        f"handle = open({str(tmp_path / 'kvserve.flock')!r}, 'a')\n"
        "fcntl.flock(handle, fcntl.LOCK_EX)\n"
        f"open({str(tmp_path / 'lock')!r}, 'w').close()  # torch's lock, mid-build\n"
        "print('holding', flush=True)\n"
        "time.sleep(60)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline() == "holding\n"
    finally:
        process.kill()
        process.wait(10)
    assert (tmp_path / "lock").exists()

    entered = threading.Event()

    def build() -> None:
        with exclusive_build(tmp_path):
            entered.set()

    with caplog.at_level(logging.WARNING, logger="kvserve.kernels.extension_build"):
        thread = threading.Thread(target=build, daemon=True)
        thread.start()
        assert entered.wait(10), "the lock of a killed process still blocks"
        thread.join(10)
    assert not (tmp_path / "lock").exists()
    assert "left by a build that was killed" in caplog.text


def test_a_build_directory_that_cannot_be_created_is_the_builders_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    directory = tmp_path / "file" / "build"
    with pytest.raises(CpuExtensionBuildError, match=f"building the test kernels in {directory} failed"):
        load_extension(directory, "kvserve_test", [], "the test kernels", CpuExtensionBuildError, sources=[])


def test_an_unwritable_cache_directory_falls_back_to_the_torch_reference(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(cpu_build.CACHE_DIR_ENV, str(tmp_path / "file"))
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)
    monkeypatch.setattr(cpu_build, "_outcome", None)  # as in a fresh worker process

    with caplog.at_level(logging.WARNING, logger="kvserve.kernels.backend"):
        assert get_attention_backend("cpu").name == "torch"
    assert "C++ CPU attention kernels unavailable" in caplog.text


@pytest.mark.parametrize("in_the_way", [None, "a pyenv shim that does not run"])
def test_ninja_beside_this_python_is_found_without_an_activated_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_the_way: str | None
) -> None:
    # `.venv/bin/kvserve serve` run without activating the environment: PATH lacks .venv/bin,
    # and may find a ninja that fails (pyenv's shim, when the active Python has none).
    scripts = sysconfig.get_path("scripts")
    compiler = shutil.which("c++")
    if shutil.which("ninja", path=scripts) is None or compiler is None:
        pytest.skip("needs ninja installed beside this Python and a C++ compiler")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "c++").symlink_to(compiler)
    if in_the_way is not None:
        shim = bin_dir / "ninja"
        shim.write_text("#!/bin/sh\necho 'pyenv: ninja: command not found' >&2\nexit 127\n")
        shim.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))

    cpu_build.check_toolchain()

    assert Path(shutil.which("ninja") or "").parent == Path(scripts)
    assert os.environ["PATH"].split(os.pathsep) == [scripts, str(bin_dir)]
