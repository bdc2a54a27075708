"""Plug-ins: modules a run imports before it reads its flags, and the trainer's step hooks they register.

``--custom-import MODULE [MODULE ...]`` (torchtitan's ``--experimental.custom_import``) imports each module
on every rank before the flags are parsed, so what it registers — a schedule (`pipeline.schedules`), a
resharding strategy (`resharding.strategies`), a model spec (`model_spec`), a step hook (below) — is a
valid choice of the flags that follow. That is how code outside the package extends a run without
editing it; the lab's benchmarks and fault trials plug in this way (``lab.signal``, ``lab.chaos.faults``).

A **step hook** is ``fn(trainer, iteration)``, called at the start of every training iteration (1-based),
after the learning rate stepped and before the forward-backward pass, on every rank.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Sequence

from .config_fields import ConfigError
from .registry import Registry

__all__ = ["StepHook", "STEP_HOOKS", "register_step_hook", "step_hooks", "custom_imports", "import_modules"]

StepHook = Callable[[Any, int], None]


def _hook_name(fn: StepHook) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


STEP_HOOKS: Registry[StepHook] = Registry("step hook", key=_hook_name)
"""Step hooks by their qualified name (``module.function``), in registration order."""

FLAG = "--custom-import"


def register_step_hook(fn: StepHook) -> StepHook:
    """Call `fn(trainer, iteration)` at the start of every training iteration of the runs that follow (the registry
    rule: the same function again is accepted, another one under its qualified name refused)."""
    if not callable(fn):
        raise TypeError(f"a step hook is a function fn(trainer, iteration), got {type(fn).__name__}")
    return STEP_HOOKS.register(fn)


def step_hooks() -> tuple[StepHook, ...]:
    """The registered step hooks, in registration order."""
    return STEP_HOOKS.items()


def custom_imports(argv: Sequence[str]) -> list[str]:
    """The modules ``--custom-import`` names in `argv` (every occurrence; ``--custom-import=M`` too), before
    any parsing: they must be imported before the parser lists the registries' choices."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg.startswith(FLAG + "="):
            out.append(arg.split("=", 1)[1])
        elif arg == FLAG:
            for nxt in argv[i + 1:]:
                if nxt.startswith("-"):
                    break
                out.append(nxt)
    return out


def import_modules(names: Sequence[str]) -> None:
    """Import each module (once); one that cannot be imported ends in one line naming it and why."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"{FLAG} {name}: cannot import it ({e}); give a module importable from here "
                              "(e.g. run from the repository root for the lab's modules)") from None
