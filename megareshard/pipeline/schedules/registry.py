"""The schedule registry: name -> `ScheduleKind`, the built-in kinds registered in order.

A new schedule of the product is one file in this package, imported here and named in `_BUILT_IN`; a schedule
from elsewhere (the lab, a test, a user's script) calls `register_schedule` before the arguments are
parsed. The CLI's choices, the arguments' checks, the generators, the runtime and the planner all
read the registry at call time, so a registered kind is everywhere at once.
"""
from __future__ import annotations

from .interleaved import EAGER_INTERLEAVED_1F1B, INTERLEAVED_1F1B
from .kind import ScheduleKind
from .warmup import EAGER_1F1B, GPIPE, ONE_F_ONE_B
from .zero_bubble import ZB_H1, ZBV

__all__ = ["register_schedule", "get_schedule", "schedule_names"]

_KINDS: dict[str, ScheduleKind] = {}


def register_schedule(kind: ScheduleKind) -> ScheduleKind:
    """Add `kind` under its name (ValueError if the name is taken); returns it."""
    if not isinstance(kind, ScheduleKind):
        raise TypeError(f"register_schedule takes a ScheduleKind, got {type(kind).__name__}")
    if not kind.name or kind.name in _KINDS:
        raise ValueError(f"schedule name {kind.name!r} is {'taken' if kind.name else 'empty'}; registered: "
                         f"{', '.join(_KINDS)}")
    _KINDS[kind.name] = kind
    return kind


def get_schedule(name: str) -> ScheduleKind:
    """The kind registered as `name`; ValueError naming the registered ones otherwise."""
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; available: {', '.join(_KINDS)}") from None


def schedule_names() -> tuple[str, ...]:
    """Every registered schedule, in registration order (the built-ins first)."""
    return tuple(_KINDS)


_BUILT_IN = (GPIPE, ONE_F_ONE_B, EAGER_1F1B, INTERLEAVED_1F1B, EAGER_INTERLEAVED_1F1B, ZB_H1, ZBV)
for _kind in _BUILT_IN:
    register_schedule(_kind)
