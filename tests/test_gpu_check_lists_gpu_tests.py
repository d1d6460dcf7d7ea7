"""scripts/gpu_check.sh runs every file of `gpu` tests: a GPU session is short and rare, and a file
left out of its list is never run on a GPU (the min_p sampler's CUDA test once was)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_file_with_gpu_tests_is_in_the_gpu_checks_list() -> None:
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    listed = set(re.findall(r"tests/[\w/]+\.py", script))
    with_gpu_tests = {
        str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
        if "mark.gpu" in path.read_text()
    }
    with_gpu_tests.discard(str(Path(__file__).relative_to(ROOT)))
    assert with_gpu_tests, "no file of gpu tests found: the search is wrong"
    assert sorted(with_gpu_tests - listed) == []
