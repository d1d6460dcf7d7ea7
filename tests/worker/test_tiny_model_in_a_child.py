"""The default tiny model created in a child process, for the processes that serve a model without
running one (``kvserve serve``'s front end, a live experiment's driver): the same model, built
elsewhere, so that none of the modules building it imports (torch.compile's, Triton's, whose
bindings print a report of leaked objects at exit) load in the caller."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.worker import tiny_model
from kvserve.worker.tiny_model import ensure_default_tiny_model, ensure_default_tiny_model_in_a_child


def test_the_child_writes_the_default_model_and_this_process_builds_nothing(tmp_path: Path, monkeypatch) -> None:
    def not_here(*args, **kwargs):
        raise AssertionError("the model was built in the calling process")

    monkeypatch.setattr(tiny_model, "create_tiny_model", not_here)
    path = ensure_default_tiny_model_in_a_child(tmp_path)
    assert path == tmp_path / "models" / "tiny-llama"
    monkeypatch.undo()
    expected = ensure_default_tiny_model()  # the suite's own copy (creation is deterministic)
    files = sorted(p.relative_to(expected) for p in expected.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file())
    assert all((expected / f).read_bytes() == (path / f).read_bytes() for f in files)
    # A current model is not written again.
    monkeypatch.setattr(tiny_model.subprocess, "run", not_here)
    assert ensure_default_tiny_model_in_a_child(tmp_path) == path


def test_a_child_that_cannot_write_the_model_is_an_error_naming_where_and_why(tmp_path: Path) -> None:
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    with pytest.raises(RuntimeError, match=rf"cannot create the default tiny model in {not_a_directory}/models/"
                                           r"tiny-llama: .*(Not a directory|FileExistsError|NotADirectoryError)"):
        ensure_default_tiny_model_in_a_child(not_a_directory)
