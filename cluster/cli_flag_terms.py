"""The settings' own errors in the terms of ``kvserve serve``'s command line.

The config dataclasses check themselves and name their fields (``max_model_len``,
``enable_chunked_prefill=False``), as a Python user sets them.  Someone who ran
``serve`` set flags, so its errors name those: a field by its flag
(``--max-model-len``), a switch's value by the flag that gives it
(``--no-chunked-prefill``), and the config file when the value came from there.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

# A field among the words of a message: lower case with at least one underscore (a lone
# "port" or "device" is more often a plain word), and a switch's value after it if any.
_FIELD = re.compile(r"(?<![\w-])([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?:=(True|False))?(?![\w(=])")


@dataclass(frozen=True, slots=True)
class FlagTerms:
    """Which flag sets each setting (``dest``), and which switch gives a setting a value."""

    flags: dict[str, str]
    switches: dict[tuple[str, bool], str]
    # Settings whose errors name things of their own: the rest of such a message is left as it is.
    verbatim: frozenset[str] = frozenset()

    @classmethod
    def of_parser(cls, parser: argparse.ArgumentParser, verbatim: frozenset[str] = frozenset()) -> FlagTerms:
        flags: dict[str, str] = {}
        switches: dict[tuple[str, bool], str] = {}
        for action in parser._actions:  # noqa: SLF001 - argparse has no public list of a parser's options
            if not action.option_strings:
                continue
            flags.setdefault(action.dest, max(action.option_strings, key=len))
            if isinstance(action, argparse.BooleanOptionalAction):
                on, off = action.option_strings
                switches[(action.dest, True)], switches[(action.dest, False)] = on, off
            elif action.nargs == 0 and isinstance(action.const, bool):  # store_true, store_false, store_const
                switches.setdefault((action.dest, action.const), action.option_strings[0])
        return cls(flags, switches, verbatim)

    def message(self, error: Exception, settings_from_file: frozenset[str] = frozenset(),
                config_file: str | None = None) -> str:
        """``error``'s message with its fields named by their flags.  A leading field (``field ...``
        or ``field: ...``) is the setting at fault: when the config file gave it, the message says so."""
        message = str(error)
        field, space, rest = message.partition(" ")
        name = field.removesuffix(":")
        flag = self.flags.get(name)
        if flag is None:
            return self._named(message)
        where = f" ({flag} from --config {config_file})" if name in settings_from_file else ""
        # NOTE: the leading field's later mentions keep its name ("--max-num-batched-tokens: the routing
        # policy's budget: max_num_batched_tokens must be ..." names a policy's argument too).
        rest = rest if name in self.verbatim else self._named(rest, keep=name)
        return f"{flag}{field[len(name):]}{space}{rest}{where}"

    def _named(self, text: str, keep: str | None = None) -> str:
        def flag_of(match: re.Match[str]) -> str:
            name, value = match.group(1), match.group(2)
            if value is not None:
                return self.switches.get((name, value == "True"), match.group(0))
            flag = self.flags.get(name)
            # NOTE: "(auth_token_file, --auth-token-file)" names both already.
            return match.group(0) if flag is None or flag in text or name == keep else flag

        return _FIELD.sub(flag_of, text)
