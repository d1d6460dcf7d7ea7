"""Checks of routing policies' constructor arguments, so that a bad one fails where it is given.

Policies are built from command-line text (``--policy-arg cost_ttft.load_factor=inf``):
an argument that passes here must not fail, or silently mean nothing, at the
first request.
"""

from __future__ import annotations

import math
from numbers import Integral, Real


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` if it is an integer (not a bool) >= ``minimum``, else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_number(name: str, value: object, minimum: float, *, above: bool = False) -> float:
    """``value`` if it is a finite real number >= ``minimum`` (> with ``above``), else ``ValueError``."""
    ok = (
        isinstance(value, Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > minimum if above else value >= minimum)
    )
    if not ok:
        relation = ">" if above else ">="
        raise ValueError(f"{name} must be a finite number {relation} {minimum:g}, got {value!r}")
    return float(value)  # type: ignore[arg-type]
