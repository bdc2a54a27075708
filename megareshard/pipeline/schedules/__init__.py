"""Pipeline schedules, one file per family, each kind owning its facts (`ScheduleKind`):

* `warmup.py`: gpipe, 1f1b, eager-1f1b (one stage per mesh, k_i forwards before the first backward);
* `interleaved.py`: interleaved-1f1b, eager-interleaved-1f1b (V stages per mesh, round robin);
* `zero_bubble.py`: zb-h1, zbv (I/W list scheduler; zbv's V-shaped placement);
* `registry.py`: `register_schedule`, `get_schedule`, `schedule_names`.

`docs/extending.md` shows a new schedule as one file and one registry line.
"""
from .kind import ScheduleKind, round_robin
from .registry import get_schedule, register_schedule, schedule_names

__all__ = ["ScheduleKind", "round_robin", "register_schedule", "get_schedule", "schedule_names"]
