"""LLM.generate's progress: on a terminal after a delay by default, always when asked, never in between."""

from __future__ import annotations

import io

import pytest

from kvserve import LLM, SamplingParams
from kvserve import generate_progress
from kvserve.generate_progress import GenerateProgress
from kvserve.worker.tiny_model import create_tiny_model

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    path = create_tiny_model(tmp_path_factory.mktemp("m"), "llama", seed=1)
    with LLM(path, block_size=4, num_blocks=64) as engine:
        yield engine


def test_progress_true_reports_the_calls_totals_on_stderr(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate([[1, 2, 3], [4, 5], [6]], PARAMS, progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith("generate: 3/3 requests, 15 tokens in ")
    assert lines[-1].endswith(" tok/s)")


def test_vllms_use_tqdm_is_progress_under_its_name(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    # Code written for vLLM passes it: it was a TypeError.
    llm.generate([[1, 2, 3]], PARAMS, use_tqdm=True)
    assert capsys.readouterr().err.splitlines()[-1].startswith("generate: 1/1 requests, 5 tokens in ")
    llm.chat([{"role": "user", "content": "hi"}], PARAMS, use_tqdm=False)
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="progress and use_tqdm are one setting"):
        llm.generate([[1, 2, 3]], PARAMS, progress=True, use_tqdm=True)
    with pytest.raises(ValueError, match="use_tqdm must be True or False, got 'yes'"):
        llm.generate([[1, 2, 3]], PARAMS, use_tqdm="yes")


def test_get_tokenizer_is_the_models_tokenizer(llm: LLM) -> None:
    assert llm.get_tokenizer() is llm.tokenizer is not None


def test_by_default_a_stream_that_is_no_terminal_shows_nothing(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate([[1, 2, 3]], PARAMS)
    llm.generate([[1, 2, 3]], PARAMS, progress=False)
    assert capsys.readouterr().err == ""


def test_on_a_terminal_it_shows_only_once_the_call_ran_the_delay_and_rewrites_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(generate_progress.time, "monotonic", lambda: now[0])
    terminal = Terminal()
    shown = GenerateProgress(4, None, terminal)
    shown.update(1, 10)
    assert terminal.getvalue() == ""  # before DELAY_S
    now[0] += generate_progress.DELAY_S
    shown.update(2, 20)
    now[0] += generate_progress.INTERVAL_S / 2
    shown.update(3, 25)  # within INTERVAL_S of the last line: not shown
    now[0] += generate_progress.INTERVAL_S
    shown.update(4, 40)
    shown.close()
    assert terminal.getvalue().split("\r\033[K")[1:] == [
        "generate: 2/4 requests, 20 tokens in 2.0 s (10 tok/s)",
        "generate: 4/4 requests, 40 tokens in 2.8 s (15 tok/s)",
        "generate: 4/4 requests, 40 tokens in 2.8 s (15 tok/s)\n",
    ]


def test_a_short_call_on_a_terminal_says_nothing() -> None:
    terminal = Terminal()
    shown = GenerateProgress(2, None, terminal)
    shown.update(2, 8)
    shown.close()
    assert terminal.getvalue() == ""
