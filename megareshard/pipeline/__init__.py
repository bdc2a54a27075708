"""Pipeline engine, pure half: schedule IR, the schedules (`schedules/`), lowering, validator, simulator.

    sched = generate("eager-1f1b", num_stages=4, num_microbatches=8, delay_wgrad=True,
                     graph=PipelineGraph(4, skip_edges=[(0, 3)]))
    low = lower(sched)            # + SEND/RECV/WAIT for every edge (see lowering.py)
    low = insert_grad_reduce(low) # + R: each stage's dp gradient reduction (--overlap-grad-reduce)
    validate(low)                 # ScheduleError on any problem, incl. deadlock
    tl = simulate(low, costs=Costs(f=1, b=2, comm=0.5))
    tl.makespan, tl.bubble_fraction, tl.peak_activations

No torch.distributed here; `runtime.py` executes lowered lists on real ranks.
"""

from .generators import delay_weight_grads, forwards_before_first_backward, generate, placement_of
from .grad_reduce import insert_grad_reduce
from .lowering import lower
from .schedule import (
    Action,
    ActionKind,
    Edge,
    PipelineGraph,
    Schedule,
    ScheduleError,
    parse_action,
)
from .schedules import ScheduleKind, get_schedule, register_schedule, schedule_names
from .simulate import CommInterval, Costs, Interval, Timeline, simulate
from .validate import validate

__all__ = [
    "Action",
    "ActionKind",
    "Edge",
    "PipelineGraph",
    "Schedule",
    "ScheduleError",
    "parse_action",
    "ScheduleKind",
    "register_schedule",
    "get_schedule",
    "schedule_names",
    "placement_of",
    "generate",
    "delay_weight_grads",
    "forwards_before_first_backward",
    "lower",
    "insert_grad_reduce",
    "validate",
    "Costs",
    "Interval",
    "CommInterval",
    "Timeline",
    "simulate",
]
