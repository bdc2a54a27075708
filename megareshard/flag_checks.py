"""Command-line checks argparse does not make, shared by every parser of the training entry points.

* ``refuse_repeated_flags``: argparse keeps the last of two values of one flag without a word; a
  flag given twice with different values on the command line (what a person or a launch script typed)
  is refused naming both. Code that builds an argument list for ``parse_args`` keeps argparse's rule, the
  last value wins: tests and tools compose a base list with overrides appended.
* ``parse_known_strictly``: argparse answers a bad value or an invalid choice with its whole usage
  block (170 lines here) and ``exit(2)``; here it is one ``ConfigError`` line that names the valid
  choices, like every other bad input.
"""
from __future__ import annotations

import argparse
from typing import Sequence

from .config_fields import ConfigError

__all__ = ["parse_known_strictly", "refuse_repeated_flags"]


def parse_known_strictly(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """``parser.parse_known_args(argv)`` whose errors are one ConfigError line (no usage block, no exit)."""
    parser.exit_on_error = False
    parser.error = _argparse_error  # type: ignore[method-assign]  # what argparse still reports through error()
    try:
        return parser.parse_known_args(list(argv))
    except argparse.ArgumentError as e:
        raise ConfigError(str(e)) from None


def _argparse_error(message: str) -> None:
    raise ConfigError(message)


def refuse_repeated_flags(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """A flag given twice with different values (``--hidden-size 64 --hidden-size 128``, or two spellings of one
    option) is refused naming both: argparse would keep the last one silently. The same value twice is harmless
    (launch scripts assemble flags from several arrays)."""
    seen: dict[str, tuple[str, str]] = {}  # dest -> (flag, value as given)
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        name, eq, inline = token.partition("=")
        action = parser._option_string_actions.get(name) if token.startswith("--") else None  # no public lookup
        if action is None:
            continue
        if eq:
            value = inline
        elif action.nargs == 0:
            value = ""
        elif action.nargs is None or action.nargs == 1:
            value = argv[i] if i < len(argv) else ""
            i += 1
        else:  # a list: the tokens up to the next flag
            start = i
            while i < len(argv) and not (argv[i].startswith("-") and not _is_number(argv[i])):
                i += 1
            value = " ".join(argv[start:i])
        first = seen.setdefault(action.dest, (name, value))
        if first[1] != value and _typed(action, first[1]) != _typed(action, value):  # '0.0' and '0' agree
            if first[0] == name:
                raise ConfigError(f"{name} is given twice ({first[1]}, then {value}): give it once (the last one "
                                  "would win silently)")
            raise ConfigError(f"{first[0]} {first[1]} and {name} {value} set the same option: give one of them")


def _typed(action: argparse.Action, value: str) -> object:
    """``value`` as the flag's type makes it (a list flag's words one by one); the text itself when it does not
    convert (argparse will say why)."""
    if not callable(action.type):
        return value
    try:
        return tuple(action.type(v) for v in value.split()) if action.nargs not in (None, 1) else action.type(value)
    except (TypeError, ValueError):
        return value


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True
