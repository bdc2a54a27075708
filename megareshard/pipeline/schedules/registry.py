"""The schedule registry: name -> `ScheduleKind`, the built-in kinds registered in order.

A new schedule of the product is one file in this package, imported here and named in `_BUILT_IN`; a schedule
from elsewhere (the lab, a test, a user's script) calls `register_schedule` before the arguments are
parsed. The CLI's choices, the arguments' checks, the generators, the runtime and the planner all
read the registry at call time, so a registered kind is everywhere at once.
"""
from __future__ import annotations

from ...registry import Registry
from .interleaved import EAGER_INTERLEAVED_1F1B, INTERLEAVED_1F1B
from .kind import ScheduleKind
from .warmup import EAGER_1F1B, GPIPE, ONE_F_ONE_B
from .zero_bubble import ZB_H1, ZBV

__all__ = ["SCHEDULES", "register_schedule", "get_schedule", "schedule_names"]

SCHEDULES: Registry[ScheduleKind] = Registry("schedule", type_=ScheduleKind)


def register_schedule(kind: ScheduleKind) -> ScheduleKind:
    """Add `kind` under its name (the registry rule: `megareshard.registry`); returns it."""
    return SCHEDULES.register(kind)


def get_schedule(name: str) -> ScheduleKind:
    """The kind registered as `name`; a ConfigError naming the registered ones otherwise."""
    return SCHEDULES.get(name)


def schedule_names() -> tuple[str, ...]:
    """Every registered schedule, in registration order (the built-ins first)."""
    return SCHEDULES.names()


_BUILT_IN = (GPIPE, ONE_F_ONE_B, EAGER_1F1B, INTERLEAVED_1F1B, EAGER_INTERLEAVED_1F1B, ZB_H1, ZBV)
for _kind in _BUILT_IN:
    register_schedule(_kind)
