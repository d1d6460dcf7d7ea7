"""``kvserve serve --config FILE.yaml``: a file of flags, which the command line overrides.

The file is a YAML mapping whose keys are serve's long flag names, without the
dashes in front (``max-num-seqs``; ``max_num_seqs`` works too)::

    model: /models/llama-3.1-8b-instruct
    replicas: 2
    http-port: 8080
    routing-arg: [cache_threshold=0.5]   # a repeatable flag takes a list
    simulated: true                       # a switch: true to set it

It is read as the flags it stands for, placed before those of the command
line, so the command line wins where both set a value, and every value is
parsed and checked exactly as the flag's own.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

CONFIG_FLAG = "--config"


def expand_config_file(subparser: argparse.ArgumentParser, argv: Sequence[str], command: str) -> list[str]:
    """``argv`` with the flags of ``command``'s ``--config FILE`` put in place of it.

    ``ValueError`` for a file that cannot be read, is not a mapping, or names
    an unknown flag (the message says which).
    """
    argv = list(argv)
    if command not in argv:
        return argv
    start = argv.index(command) + 1
    path, rest = _take_config_flag(argv[start:])
    if path is None:
        return argv
    return [*argv[:start], *config_file_args(subparser, Path(path)), *rest]


def config_file_args(subparser: argparse.ArgumentParser, path: Path) -> list[str]:
    """The flags that ``path`` stands for, in the file's order."""
    import yaml

    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{CONFIG_FLAG} {path}: {exc.strerror or exc}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ValueError(f"{CONFIG_FLAG} {path}: not valid YAML: {exc}") from None
    if values is None:
        return []
    if not isinstance(values, dict):
        kind = type(values).__name__
        raise ValueError(f"{CONFIG_FLAG} {path}: expected a mapping of flag names to values, got {kind}")
    actions = {
        option.removeprefix("--"): action
        for action in subparser._actions  # noqa: SLF001 - argparse has no public list of a parser's options
        for option in action.option_strings
        if option.startswith("--") and option not in (CONFIG_FLAG, "--help")
    }
    args: list[str] = []
    for key, value in values.items():
        name = str(key).replace("_", "-")
        action = actions.get(name)
        if action is None:
            known = ", ".join(sorted(actions))
            raise ValueError(f"{CONFIG_FLAG} {path}: unknown key {key!r}; the keys are serve's flags: {known}")
        args += _flag_args(f"--{name}", action, value, path)
    return args


def _flag_args(flag: str, action: argparse.Action, value: object, path: Path) -> list[str]:
    if action.nargs == 0:  # a switch (store_true, store_const)
        if not isinstance(value, bool):
            raise ValueError(f"{CONFIG_FLAG} {path}: {flag[2:]} is a switch: true or false, got {value!r}")
        return [flag] if value else []
    if isinstance(value, list):
        if not isinstance(action, argparse._AppendAction):  # noqa: SLF001
            raise ValueError(f"{CONFIG_FLAG} {path}: {flag[2:]} takes one value, got a list")
        return [arg for item in value for arg in (flag, _scalar(item))]
    if isinstance(value, dict) or value is None:
        raise ValueError(f"{CONFIG_FLAG} {path}: {flag[2:]} needs a value, got {value!r}")
    return [flag, _scalar(value)]


def _scalar(value: object) -> str:
    # NOTE: YAML's true/false as the flag parsers spell them (a routing arg's literal).
    return str(value)


def _take_config_flag(args: list[str]) -> tuple[str | None, list[str]]:
    """The path of ``--config PATH`` (or ``--config=PATH``) in ``args``, and ``args`` without it."""
    for i, arg in enumerate(args):
        if arg == CONFIG_FLAG and i + 1 < len(args):
            return args[i + 1], args[:i] + args[i + 2 :]
        if arg.startswith(f"{CONFIG_FLAG}="):
            return arg.split("=", 1)[1], args[:i] + args[i + 1 :]
        if arg == "--":
            break
    return None, args
