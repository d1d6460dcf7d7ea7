"""``kvserve serve --config FILE.yaml``: a file of flags, which the command line overrides.

The file is a YAML mapping whose keys are serve's long flag names, without the
dashes in front (``max-num-seqs``; ``max_num_seqs`` works too)::

    model: /models/llama-3.1-8b-instruct
    replicas: 2
    http-port: 8080
    routing-arg: [cache_threshold=0.5]   # a repeatable flag takes a list
    simulated: true                       # a switch: true to set it
    async-scheduling: false               # one with a --no- form: true or false say which

Each value is parsed and checked exactly as the flag's own, and a flag given twice
(``replicas`` twice, or ``max_num_seqs`` beside ``max-num-seqs``) is an error.  A setting that the
command line sets is taken from the command line: ``--no-http`` there turns off
the file's ``http-port`` and ``--http-port`` there the file's ``no-http``, and a
repeatable flag there replaces the file's whole list.  Flags that exclude each
other are an error only when given together in one place.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

CONFIG_FLAG = "--config"


# Settings that are one on the command line: -v is --log-level debug, so either there overrides both in a file.
_ONE_SETTING = ({"verbose", "log_level"},)


def parse_args_with_config_file(
    parser: argparse.ArgumentParser, subparser: argparse.ArgumentParser, argv: Sequence[str], command: str
) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with the settings of ``command``'s ``--config FILE`` where
    the command line does not set them (``subparser``: ``command``'s parser).

    The file is the one argparse takes (``--config``, its abbreviations, the last one given).  With
    one, the namespace's ``settings_from_file`` names the settings taken from it (their ``dest``);
    without, it has no such attribute (other commands write their namespace out).  ``ValueError``
    for a file that cannot be read, is not a mapping, names an unknown flag or gives a bad value
    (the message names the file).
    """
    argv = list(argv)
    # NOTE: the command line is parsed as if there were no file (so that two flags that exclude
    # each other are refused only when both are there), then the file fills in what it left unset.
    args = parser.parse_args(argv)
    path = getattr(args, CONFIG_FLAG.removeprefix("--"), None)
    if path is None or command not in argv:
        return args
    from_file = config_file_settings(subparser, Path(path))
    start = argv.index(command) + 1
    given = set(_settings_given(subparser, argv[start:], on_error=parser.error))
    # Those before the command (kvserve --log-level error serve ...), the main parser's own.
    main_dests = {action.dest for action in parser._actions}  # noqa: SLF001
    given |= set(_settings_given(parser, argv[:start], on_error=parser.error)) & main_dests
    for setting in _ONE_SETTING:
        if given & setting:
            given |= setting
    taken = {dest: value for dest, value in from_file.items() if dest not in given}
    for dest, value in taken.items():
        setattr(args, dest, value)
    args.settings_from_file = frozenset(taken)
    return args


def config_file_settings(subparser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """The settings (``dest`` -> parsed value) that the flags of ``path`` set, and only those."""

    def fail(message: str) -> NoReturn:
        raise ValueError(f"{CONFIG_FLAG} {path}: {message}")

    return _settings_given(subparser, config_file_args(subparser, path), on_error=fail)


def _settings_given(
    parser: argparse.ArgumentParser, args: list[str], on_error: Callable[[str], NoReturn]
) -> dict[str, Any]:
    """The settings (``dest`` -> value) that the flags in ``args`` set, parsed by ``parser``; its
    defaults left out.  ``on_error(message)`` for a bad flag or value, in place of argparse's exit."""
    actions = parser._actions  # noqa: SLF001 - argparse has no public list of a parser's options
    defaults = [action.default for action in actions]
    # NOTE: argparse fills in only the defaults that are not suppressed, so with all of them
    # suppressed the namespace holds just what ``args`` set.
    for action in actions:
        action.default = argparse.SUPPRESS
    parser.error = on_error  # type: ignore[method-assign]
    try:
        namespace = parser.parse_args(args)
    finally:
        del parser.error
        for action, default in zip(actions, defaults, strict=True):
            action.default = default
    dests = {action.dest for action in actions}
    return {dest: value for dest, value in vars(namespace).items() if dest in dests}


def config_file_args(subparser: argparse.ArgumentParser, path: Path) -> list[str]:
    """The flags that ``path`` stands for, in the file's order."""
    import yaml

    try:
        values = yaml.load(path.read_text(encoding="utf-8"), Loader=_loader_refusing_repeated_keys())
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
    keys: dict[str, object] = {}
    for key, value in values.items():
        name = str(key).replace("_", "-")
        action = actions.get(name)
        if action is None:
            known = ", ".join(sorted(actions))
            raise ValueError(f"{CONFIG_FLAG} {path}: unknown key {key!r}; the keys are serve's flags: {known}")
        if name in keys:  # max_num_seqs and max-num-seqs
            raise ValueError(f"{CONFIG_FLAG} {path}: {keys[name]!r} and {key!r} are the same flag, --{name}")
        keys[name] = key
        args += _flag_args(f"--{name}", action, value, path)
    return args


def _loader_refusing_repeated_keys() -> type:
    """YAML's safe loader, but a key given twice in one mapping is an error (PyYAML keeps the last
    silently, and a file's second ``replicas:`` would quietly undo its first)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
            seen: set[object] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # <<: *defaults
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, (str, int, float, bool)) or key is None:
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"the key {key!r} is given twice", key_node.start_mark
                        )
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return Loader


def _flag_args(flag: str, action: argparse.Action, value: object, path: Path) -> list[str]:
    if action.nargs == 0:  # a switch (store_true, store_const, --FLAG / --no-FLAG)
        if not isinstance(value, bool):
            raise ValueError(f"{CONFIG_FLAG} {path}: {flag[2:]} is a switch: true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            # NOTE: its default may be neither (None: decided later), so false must say which.
            on, off = action.option_strings
            return [on if value == (flag == on) else off]
        return [flag] if value else []
    if isinstance(value, list):
        if not isinstance(action, argparse._AppendAction):  # noqa: SLF001
            raise ValueError(f"{CONFIG_FLAG} {path}: {flag[2:]} takes one value, got a list")
        return [f"{flag}={_scalar(item)}" for item in value]
    if isinstance(value, dict) or value is None:
        raise ValueError(f"{CONFIG_FLAG} {path}: {flag[2:]} needs a value, got {value!r}")
    # NOTE: FLAG=VALUE, so that a value that starts with a dash is not read as a flag.
    return [f"{flag}={_scalar(value)}"]


def _scalar(value: object) -> str:
    # NOTE: YAML's true/false as the flag parsers spell them (a routing arg's literal).
    return str(value)
