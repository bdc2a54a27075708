"""The error type and the field helper shared by every config dataclass.

Lives apart from the command-line module so that ``models/config.py`` can define the
model's config without importing the argument parser (which imports it).
"""
from __future__ import annotations

import importlib
from dataclasses import field
from typing import Any, Callable, Sequence

__all__ = ["ConfigError", "config_field", "registry_choices"]


class ConfigError(ValueError):
    """Invalid or inconsistent arguments; the message names the values and why."""


def config_field(default: Any, help: str, *, flag: str | None = None,
                 choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None, metavar: str | None = None) -> Any:
    """A dataclass field whose ``help`` is its one-line docstring and its ``--flag`` help at once.

    The flag is the field name with dashes unless ``flag`` names another (``flag=""``: no flag, the field keeps its
    default on the command line — a feature built below the trainer but not offered yet); a bool field is a
    switch: ``store_true``, or ``store_false`` for one that defaults to True (its flag is then the
    ``--no-...`` form, Megatron's spelling). ``choices`` may be a function, asked when the parser is built
    (a registry's names: what registers after this module is imported is still a choice).
    """
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices, "metavar": metavar})


def registry_choices(module: str, names: str) -> Callable[[], Sequence[str]]:
    """``choices`` read from a registry when the parser is built: ``module.names()`` (e.g. the schedules'
    ``schedule_names``). Named by string, so a configuration type imports no registry (it sits below them)."""
    def choices() -> Sequence[str]:
        return getattr(importlib.import_module(module), names)()

    choices.__qualname__ = f"{module}.{names}"
    return choices
