"""What more than one subcommand reads the same way: the values of ``KEY=VALUE`` settings
(``kvserve serve --routing-arg``, ``kvserve experiment --policy-arg`` and ``--workload-arg``),
``--cost-model`` (``serve --simulated``, ``experiment``), and text that must be UTF-8."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.scheduler.cost_model import StepCostModel


def check_utf8(text: str, name: str) -> None:
    """``ValueError`` naming the argument ``name`` unless ``text`` is valid UTF-8.

    NOTE: Python decodes the command line with ``surrogateescape``: each byte that is not
    UTF-8 becomes a lone surrogate, which protobuf, the tokenizer and the sockets refuse
    later with a traceback.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raw = text.encode("utf-8", "surrogateescape")
        offset = len(text[: exc.start].encode("utf-8", "surrogateescape"))
        raise ValueError(f"{name} is not valid UTF-8 text (byte 0x{raw[offset]:02x} at offset {offset})") from None


def setting_value(text: str) -> Any:
    """``text`` as an int, a float, a bool (``true``/``false``, any case), ``None``
    (``none``, any case), or else the text itself (stripped)."""
    text = text.strip()
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    return text


def key_value(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as ``(key, setting_value(VALUE))``; ``ValueError`` unless KEY is a name."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    return key, setting_value(value)


def add_cost_model_flag(parser: argparse.ArgumentParser, when: str) -> None:
    """``--cost-model FILE_OR_NAME``, the step cost model of simulated steps (``when``: the
    condition under which it applies, for --help); read it with ``cost_model_of_flag``."""
    parser.add_argument(
        "--cost-model", type=Path, default=None, metavar="FILE_OR_NAME",
        help=f"{when}the step cost model, a JSON file or a measured model's name such as llama-3-8b-h100 "
        "(default: StepCostModel.default(), an 8B model on an H100)",
    )


def cost_model_of_flag(value: Path | None) -> StepCostModel:
    """``--cost-model``'s model (the default one when not given); ``ValueError`` naming the flag."""
    from kvserve.scheduler.cost_model import StepCostModel

    if value is None:
        return StepCostModel.default()
    try:
        return StepCostModel.load(value)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"--cost-model {value}: {getattr(exc, 'strerror', None) or exc}") from None
