"""Checks of user-given settings, so that a bad one fails where it is given.

Settings often come from the command line as parsed text
(``--policy-arg cost_ttft.load_factor=inf``, ``--workload-arg think_time=nan``):
a check rejects the wrong type (a float count, a bool) as well as a value out
of range and non-finite numbers, which would otherwise fail, hang or silently
mean nothing far from where they were given.  Each raises ``ValueError``
naming the setting::

    check_ints(1, num_groups=num_groups, output_len=output_len)
    check_numbers(1, above=True, load_factor=load_factor)
"""

from __future__ import annotations

import math
from numbers import Integral, Real


class SettingError(ValueError):
    """A setting that is valid on its own but that this machine cannot run with (a KV-cache budget
    too small for two blocks): its message names the setting and what it would take, which says it
    all; no traceback is needed to find the cause."""


def check_ints(minimum: int, **values: object) -> None:
    """``ValueError`` unless every value is an integer (not a bool) >= ``minimum``."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_positive_ints(**values: object) -> None:
    """``ValueError`` unless every value is an integer (not a bool) >= 1: "NAME must be a positive integer"."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_block_size(block_size: object) -> None:
    """``ValueError`` unless ``block_size`` (tokens per KV block) is an integer >= 1."""
    check_ints(1, block_size=block_size)


def check_num_blocks(num_blocks: object) -> None:
    """``ValueError`` unless ``num_blocks`` (KV blocks of one pool, the null block included)
    is an integer >= 2."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, Integral) or num_blocks < 2:
        raise ValueError(f"num_blocks must be an integer >= 2 (block 0 is the null block), got {num_blocks!r}")


def check_tenant_cache_share(share: object) -> None:
    """``ValueError`` unless ``share`` (``tenant_cache_share``) is ``None`` or a number in (0, 1]."""
    if share is not None:
        check_numbers(0.0, above=True, maximum=1.0, tenant_cache_share=share)


def check_numbers(
    minimum: float, *, above: bool = False, maximum: float = math.inf, **values: object
) -> None:
    """``ValueError`` unless every value is a finite number (not a bool) >= ``minimum`` (> with
    ``above``) and <= ``maximum``."""
    for name, value in values.items():
        ok = (
            isinstance(value, Real)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and (value > minimum if above else value >= minimum)
            and value <= maximum
        )
        if not ok:
            relation = ">" if above else ">="
            most = f" and <= {maximum:g}" if maximum < math.inf else ""
            raise ValueError(f"{name} must be a finite number {relation} {minimum:g}{most}, got {value!r}")
