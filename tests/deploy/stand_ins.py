"""What the deploy scripts' stand-in programs (a fake ``kvserve`` or ``ray`` on PATH) recorded."""

from __future__ import annotations

import time
from pathlib import Path


def recorded_lines(path: Path, count: int, timeout_s: float = 20.0) -> list[str]:
    """The lines of the record ``path`` once it has at least ``count`` of them."""
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"expected {count} lines in {path.name} from the stand-ins, got {lines}")
