"""Every Python package folder is installed, and package data ships with it."""

from __future__ import annotations

from pathlib import Path

from tests.toml_reader import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {Path(folder) for folder in setuptools["package-dir"].values()}
    folders = {
        init.parent.relative_to(ROOT)
        for init in ROOT.glob("*/**/__init__.py")
        if init.parts[len(ROOT.parts)] not in {"tests", "build", ".venv"}
    }
    assert folders - mapped == set()
    assert set(setuptools["packages"]) == set(setuptools["package-dir"])


def test_tiny_model_corpus_is_package_data() -> None:
    from importlib import resources

    corpus = resources.files("kvserve.worker").joinpath("data/tiny_corpus.txt")
    assert len(corpus.read_text(encoding="utf-8")) > 10_000


def test_measured_cost_models_are_package_data() -> None:
    from importlib import resources

    from kvserve.scheduler.cost_model import StepCostModel

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "cost_models/*.json" in setuptools["package-data"]["kvserve.scheduler"]
    shipped = resources.files("kvserve.scheduler").joinpath("cost_models/llama-3-8b-h100.json")
    assert StepCostModel.from_json(shipped.read_text()).a > 0
