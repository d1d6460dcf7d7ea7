"""Simple commands of shell scripts, for tests that check the command lines of docs and configs.

Enough of the shell for deployment files: ``;``, ``&&``, ``||``, ``|``, ``&``, redirections,
``NAME=value`` prefixes, ``nohup``/``exec`` and control-flow keywords, and the scripts
given to ``bash -c``, ``ssh`` and ``ray exec``.  Not a shell: no expansion, no functions.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

_PUNCTUATION = set("();<>|&")
# Words that may come before a command's name.
_PREFIXES = {"nohup", "exec", "time", "command", "if", "then", "else", "elif", "do", "while", "until", "!", "{"}
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_FD_BEFORE_REDIRECT = re.compile(r"(^|\s)\d+(?=[<>])")  # the `2` of `2>&1`


@dataclass(frozen=True, slots=True)
class SimpleCommand:
    """One simple shell command: its leading ``NAME=value`` assignments and its words."""

    env: dict[str, str]
    argv: tuple[str, ...]


def _runs_a_script(argv: tuple[str, ...]) -> bool:
    """Whether a command's arguments include a shell script of their own."""
    return Path(argv[0]).name in {"bash", "sh", "ssh"} or argv[:2] == ("ray", "exec")


def simple_commands(script: str) -> list[SimpleCommand]:
    """The simple commands of a shell script, including those in the script arguments of
    ``bash -c``, ``ssh`` and ``ray exec``; redirections are dropped."""
    commands: list[SimpleCommand] = []

    def add(env: dict[str, str], argv: list[str]) -> None:
        if argv:
            commands.append(SimpleCommand(env, tuple(argv)))
            if _runs_a_script(tuple(argv)):
                for arg in argv[1:]:
                    if any(char.isspace() for char in arg):
                        commands.extend(simple_commands(arg))

    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(_FD_BEFORE_REDIRECT.sub(r"\1", line), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        env: dict[str, str] = {}
        argv: list[str] = []
        skip_redirect_target = False
        for token in lexer:
            if skip_redirect_target:
                skip_redirect_target = False
            elif set(token) <= _PUNCTUATION:
                skip_redirect_target = "<" in token or ">" in token
                if not skip_redirect_target:
                    add(env, argv)
                    env, argv = {}, []
            elif not argv and token in _PREFIXES:
                continue
            elif not argv and _ASSIGNMENT.match(token):
                name, value = token.split("=", 1)
                env[name] = value
            else:
                argv.append(token)
        add(env, argv)
    return commands


def markdown_shell_scripts(text: str) -> list[str]:
    """The shell code blocks of a Markdown text: fenced blocks labelled bash, sh or
    shell, or not labelled."""
    return [block for language, block in _markdown_blocks(text) if language in _SHELL_LANGUAGES]


def markdown_code_spans(text: str) -> list[str]:
    """The inline code spans of a Markdown text, outside its code blocks."""
    prose = "\n".join(block for language, block in _markdown_blocks(text) if language is None)
    return re.findall(r"`([^`\n]+)`", prose)


_SHELL_LANGUAGES = {"", "bash", "sh", "shell"}


def _markdown_blocks(text: str) -> list[tuple[str | None, str]]:
    """The text split into prose (language ``None``) and fenced code blocks."""
    parts: list[tuple[str | None, list[str]]] = [(None, [])]
    for line in text.splitlines():
        fence = re.fullmatch(r"\s*```\s*(\w*)\s*", line)
        if fence:
            parts.append((fence[1], []) if parts[-1][0] is None else (None, []))
        else:
            parts[-1][1].append(line)
    return [(language, "\n".join(lines)) for language, lines in parts]
