"""ARCHITECTURE.md's layers, checked on every import of every product module.

A package may import the packages above it in the table (and itself); the lowest
layers also name the third-party packages they may use, so that the control plane
stays plain Python.  Imports inside functions count too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# ARCHITECTURE.md's table, top to bottom: each package may import those before it.
LAYERS = ("scheduler", "kernels", "worker", "proto", "cluster", "experiments", "kvserve", "bench")
# Third-party packages allowed where the table restricts them (elsewhere: any).
THIRD_PARTY = {
    "scheduler": {"numpy", "xxhash"},
    "kernels": {"torch", "triton", "numpy"},
    "worker": {"torch", "transformers", "tokenizers", "safetensors", "numpy", "jinja2"},
    "proto": {"google", "grpc", "grpc_tools"},
}


def imports_of(path: Path) -> list[tuple[str, int]]:
    """Every absolute module ``path`` imports, with its line; a relative import is an error."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: a relative import (the table is checked on absolute ones)"
            found.append((node.module, node.lineno))
            if node.module == "kvserve":  # `from kvserve import bench` imports the package kvserve.bench
                found += [(f"kvserve.{alias.name}", node.lineno) for alias in node.names]
    return found


def layer_of(module: str) -> str | None:
    """The package of a ``kvserve.*`` module (``kvserve`` for the top package itself); None for others."""
    parts = module.split(".")
    if parts[0] != "kvserve":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "kvserve"


@pytest.mark.parametrize("package", LAYERS)
def test_each_package_imports_only_what_its_layer_may(package: str) -> None:
    allowed_layers = set(LAYERS[: LAYERS.index(package) + 1])
    files = sorted((ROOT / package).glob("**/*.py"))
    assert files, f"{package}/ has no Python files"
    offenders = []
    for path in files:
        name = str(path.relative_to(ROOT))
        for module, line in imports_of(path):
            top = module.split(".")[0]
            layer = layer_of(module)
            if layer is not None:
                if layer not in allowed_layers:
                    offenders.append(f"{name}:{line} imports {module}")
            elif package in THIRD_PARTY and top not in sys.stdlib_module_names and top != "__future__":
                if top not in THIRD_PARTY[package]:
                    offenders.append(f"{name}:{line} imports {module}")
    assert not offenders, "\n".join(offenders)


def test_the_check_catches_an_upward_import_and_an_unlisted_package(tmp_path, monkeypatch) -> None:
    # The previous check forbade five names in scheduler/ only: kvserve.worker or yaml passed.
    fake_root = tmp_path
    for package in LAYERS:
        (fake_root / package).mkdir()
        (fake_root / package / "ok.py").write_text("import json\n")
    (fake_root / "scheduler" / "bad.py").write_text("import yaml\nfrom kvserve.worker.worker import Worker\n")
    (fake_root / "kvserve" / "bad.py").write_text("from kvserve import bench\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake_root)
    with pytest.raises(AssertionError) as info:
        test_each_package_imports_only_what_its_layer_may("scheduler")
    assert "scheduler/bad.py:1 imports yaml" in str(info.value)
    assert "scheduler/bad.py:2 imports kvserve.worker.worker" in str(info.value)
    test_each_package_imports_only_what_its_layer_may("cluster")  # a lower layer is fine
    with pytest.raises(AssertionError, match="kvserve/bad.py:1 imports kvserve.bench"):
        test_each_package_imports_only_what_its_layer_may("kvserve")
