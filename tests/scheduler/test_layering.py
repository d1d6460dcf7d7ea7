"""The control plane stays plain Python: no torch, Ray or gRPC in scheduler/."""

from __future__ import annotations

import ast
from pathlib import Path

FORBIDDEN = {"torch", "ray", "grpc", "transformers", "google"}
SCHEDULER_DIR = Path(__file__).resolve().parents[2] / "scheduler"


def imported_top_level_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module.split(".")[0])
    return modules


def test_scheduler_package_imports_no_heavy_frameworks() -> None:
    files = sorted(SCHEDULER_DIR.glob("**/*.py"))
    assert files, "scheduler/ has no Python files"
    offenders = {
        str(path.relative_to(SCHEDULER_DIR)): sorted(imported_top_level_modules(path) & FORBIDDEN)
        for path in files
    }
    assert {name: mods for name, mods in offenders.items() if mods} == {}
