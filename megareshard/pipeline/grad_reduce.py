"""Gradient reduction as an action: the lowering pass that inserts ``R`` (pure, no torch).

``R`` on stage s starts s's data-parallel gradient reduction (the DP all-reduce, or ZeRO's
reduce-scatter into the optimizer shards) *asynchronously*; the trainer waits for it right
before the optimizer step. Placed by this pass right after the stage's last backward action
(B, or W under delayed weight gradients) and the sends that follow it, so the reduction of a
stage that finishes early overlaps the rest of the pipeline — the later stages' tails, the
sends still draining, and (with several stages per mesh) the mesh's other stages. That is
what Megatron-LM's ``--overlap-grad-reduce`` means under pipeline parallelism — gradients are
reduced once per iteration, after a model chunk's last microbatch, overlapping what follows —
at the granularity of a stage: Megatron launches each bucket from a hook during that last
backward, R launches all of the stage's buckets right after it.

The runtime runs ``R`` through a handler the trainer registers
(``PipelineRuntime.grad_reduce_handler = fn(stage)``); every rank of a mesh runs the same
program, so every data-parallel member of a stage issues the same collectives in the same
order, from the thread that runs the program.

Rules (`validate` checks them): no R at all, or exactly one per stage, after every B/I/W of its
stage. The simulator gives R the cost ``Costs.reduce`` (default 0: launching is free) and
counts the reduction's own time as running beside the program (see `simulate`).
"""
from __future__ import annotations

from .schedule import Action, ActionKind, Schedule, ScheduleError

__all__ = ["insert_grad_reduce", "has_grad_reduce"]

_K = ActionKind


def has_grad_reduce(schedule: Schedule) -> bool:
    """True when some program already holds an R action."""
    return any(a.kind.is_reduce for acts in schedule.actions for a in acts)


def insert_grad_reduce(schedule: Schedule) -> Schedule:
    """A new schedule with one R per stage after its last backward action (and the sends right after it).

    Works on compute-only and lowered schedules. A schedule that already holds R actions is
    returned unchanged (a schedule file may place them by hand; `validate` checks them).
    """
    if has_grad_reduce(schedule):
        return schedule
    out: list[list[Action]] = []
    for m, acts in enumerate(schedule.actions):
        last: dict[int, int] = {}
        for i, a in enumerate(acts):
            if a.kind in (_K.B, _K.I, _K.W):
                last[a.stage] = i
        missing = [s for s in schedule.stages_of(m) if s not in last]
        if missing:
            raise ScheduleError(f"insert_grad_reduce: stage(s) {missing} of mesh {m} run no backward: nothing "
                                "to reduce (a forward-only program takes no R)")
        after: dict[int, list[Action]] = {}
        for stage, i in last.items():
            j = i + 1
            while j < len(acts) and acts[j].kind in (_K.SEND_B, _K.SEND_F) and acts[j].stage == stage:
                j += 1  # the gradient that the previous stage waits for leaves first
            after.setdefault(j, []).append(Action(_K.R, 0, stage))
        new: list[Action] = []
        for i, a in enumerate(acts):
            new.extend(after.get(i, ()))
            new.append(a)
        new.extend(after.get(len(acts), ()))
        out.append(new)
    return Schedule(schedule.graph, schedule.num_microbatches, out, schedule.name, schedule.placement)
