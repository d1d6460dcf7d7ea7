"""Names written in two layers (the lower one cannot import the higher) stay the same."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_configs_attention_backends_and_dtypes_are_those_the_workers_know() -> None:
    from kvserve.kernels.backend import BACKEND_NAMES
    from kvserve.scheduler.engine_config import ATTENTION_BACKENDS, DTYPES
    from kvserve.worker.worker import _DTYPES

    assert ATTENTION_BACKENDS == BACKEND_NAMES
    assert set(DTYPES) == {"auto", *_DTYPES}


def test_the_checkouts_version_is_pyprojects() -> None:
    # `kvserve --version` from a checkout that is not installed reads kvserve.__version__.
    import kvserve

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert kvserve.__version__ == pyproject["project"]["version"]
