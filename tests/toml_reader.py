"""``tomllib``, or on Python 3.10 (pyproject's oldest) pytest's own TOML parser, which has its API."""

from __future__ import annotations

try:
    import tomllib  # novermin: the fallback below covers 3.10
except ModuleNotFoundError:
    import tomli as tomllib

__all__ = ["tomllib"]
