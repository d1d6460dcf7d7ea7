"""Lower layers never import higher ones: no product package imports the benchmarks."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = ("scheduler", "worker", "kernels", "proto", "cluster", "kvserve", "experiments")


def imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def test_no_product_package_imports_the_benchmarks() -> None:
    files = [path for package in PRODUCT_PACKAGES for path in sorted((ROOT / package).glob("**/*.py"))]
    assert len(files) > 100
    offenders = {
        str(path.relative_to(ROOT)): sorted(m for m in imported_modules(path) if m.startswith("kvserve.bench"))
        for path in files
    }
    assert {name: modules for name, modules in offenders.items() if modules} == {}
