"""argparse types the benchmarks share: a bad number is a usage error naming the flag, before any work."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer no less than ``minimum``, else a usage error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def float_above(minimum: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number greater than ``minimum``, else a usage error."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > minimum):
            raise argparse.ArgumentTypeError(f"expected a finite number > {minimum:g}, got {text!r}")
        return value

    return parse


def positive_ints(text: str) -> tuple[int, ...]:
    """An argparse ``type``: comma-separated integers >= 1, e.g. ``1,16,64``, else a usage error."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def number_list(minimum: float, maximum: float, *, above: bool, what: str) -> Callable[[str], list[float]]:
    """An argparse ``type``: comma-separated finite numbers in the range ``what`` says, else a usage error."""

    def parse(text: str) -> list[float]:
        try:
            values = [float(item) for item in text.split(",")]
        except ValueError:
            values = []
        ok = values and all(
            math.isfinite(v) and (v > minimum if above else v >= minimum) and v <= maximum for v in values
        )
        if not ok:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers {what}, got {text!r}")
        return values

    return parse


def model_directory(text: str) -> Path:
    """An argparse ``type``: a directory with a ``config.json`` of an architecture kvserve runs (a model
    to load), else a usage error."""
    path = Path(text)
    if not (path / "config.json").is_file():
        reason = "no such directory" if not path.is_dir() else "it has no config.json"
        raise argparse.ArgumentTypeError(f"{text!r} is not a model directory: {reason}")
    from kvserve.worker.model_config import ModelConfig
    from kvserve.worker.models import supported_architectures

    try:
        architecture = ModelConfig.from_pretrained(path).architecture
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if architecture not in supported_architectures():
        raise argparse.ArgumentTypeError(
            f"{text!r}: kvserve does not run {architecture}; it runs {', '.join(sorted(supported_architectures()))}"
        )
    return path


def unwritable_reason(path: Path) -> str | None:
    """Why a file cannot be written at ``path`` (checked by opening it to append, as a benchmark's
    output will be; a file this creates is removed again), or ``None`` if it can: checked before the
    minutes of measuring rather than after them."""
    if path.is_dir() or not path.parent.is_dir():
        return "not a file in an existing directory"
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    if not existed:
        path.unlink()
    return None
