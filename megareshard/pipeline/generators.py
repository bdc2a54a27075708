"""The generator front: `generate` builds any registered schedule (`schedules/`: one file per family,
each `ScheduleKind` owning its facts), optionally with delayed weight gradients.

Delayed weight gradients (`delay_wgrad=True`): every B(mb) becomes I(mb), which runs
where B ran (its output is what the previous stage waits for, so it must not be
delayed), plus W(mb) pushed onto a FIFO queue. The rule that places W's: **before
each compute action that needs a receive** (an F with an incoming edge, an I with an
outgoing edge) pop and run the oldest queued W, and flush whatever is left at the end
of the step. That is where the stage would otherwise sit idle waiting for a tensor in
flight, and right after I the queued W runs while I's gradient is being sent (the
paper's backward weight delaying). W therefore always follows its own I, and at most
a couple of W's are pending at a time, which bounds the extra activation memory
(activations stay live until W: W still needs the layer inputs). Zero-bubble kinds are
I/W schedules by definition (`ScheduleKind.zero_bubble`: delayed W implied).

The runtime executes every registered kind: a rank holds the model chunks of its mesh's stages
(`runtime.py`, `chunks.py`).
"""

from __future__ import annotations

from collections import deque

from .schedule import Action, ActionKind, PipelineGraph, Schedule, ScheduleError
from .schedules import ScheduleKind, get_schedule

__all__ = ["forward_only", "generate", "forwards_before_first_backward", "delay_weight_grads", "placement_of"]

_K = ActionKind


def _kind(schedule: str | ScheduleKind) -> ScheduleKind:
    """A schedule given as its kind (a run plan's, resolved once) or by its registered name."""
    return schedule if isinstance(schedule, ScheduleKind) else get_schedule(schedule)


def placement_of(name: str | ScheduleKind, P: int, V: int = 1) -> tuple[int, ...]:
    """Mesh of every stage for schedule `name` on P meshes (V stages per mesh where the user chooses V)."""
    kind = _kind(name)
    return kind.placement(P, kind.stages_per_mesh or V)


def forwards_before_first_backward(name: str, num_stages: int, num_microbatches: int,
                                   stage: int) -> int:
    """`k_i` of a one-stage-per-mesh warm-up kind (`schedules/warmup.py`): the stage's peak live activations."""
    kind = get_schedule(name)
    if kind.warmup is None:
        raise ValueError(f"forwards_before_first_backward: {name!r} is not a warm-up schedule; simulate it for "
                         "its peak activations")
    return kind.warmup(num_stages, num_microbatches, stage)


def delay_weight_grads(schedule: Schedule) -> Schedule:
    """Split each B into I + a queued W, placed by the rule in the module docstring."""
    if schedule.is_lowered:
        raise ScheduleError("delay_weight_grads works on compute-only schedules; "
                            "apply it before lower()")
    graph = schedule.graph
    remote = [e for e in graph.edges if not schedule.is_local(e)]
    out: list[list[Action]] = []
    for acts in schedule.actions:
        queue: deque[Action] = deque()
        new: list[Action] = []
        for a in acts:
            waits = (a.kind == _K.F and any(e.dst == a.stage for e in remote)) or (
                a.kind in (_K.B, _K.I) and any(e.src == a.stage for e in remote))
            if waits and queue:
                new.append(queue.popleft())
            if a.kind == _K.B:
                new.append(Action(_K.I, a.mb, a.stage))
                queue.append(Action(_K.W, a.mb, a.stage))
            else:
                new.append(a)
        new.extend(queue)
        out.append(new)
    return Schedule(graph, schedule.num_microbatches, out, schedule.name + "+dw", schedule.placement)


def generate(name: str | ScheduleKind, num_stages: int, num_microbatches: int, delay_wgrad: bool = False,
             graph: PipelineGraph | None = None, virtual_stages: int | None = None) -> Schedule:
    """A compute-only schedule (F/B, or F/I/W when `delay_wgrad` or a zero-bubble kind); `lower()` adds comms.

    `num_stages` is the number of meshes (pipeline-parallel size P). Virtual-stage kinds put
    ``P × V`` stages on them: V = `virtual_stages` where the kind leaves V to the user (default 2),
    the kind's own otherwise (zbv: 2). `graph` defaults to the plain chain of all stages; skip edges
    only add dependencies.
    """
    kind = _kind(name)
    name = kind.name
    P, m = num_stages, num_microbatches
    if P < 1 or m < 1:
        raise ValueError(f"need num_stages >= 1 and num_microbatches >= 1, got "
                         f"num_stages={P}, num_microbatches={m}")
    V = kind.stages(virtual_stages)
    if kind.microbatch_multiple_of_pp and m % P:
        raise ValueError(f"{name}: {m} microbatches are not a multiple of the {P} pipeline stages "
                         f"(interleaving sends microbatches through the chunks in groups of {P})")
    graph = graph if graph is not None else PipelineGraph(P * V)
    if graph.num_stages != P * V:
        raise ValueError(f"graph has {graph.num_stages} stages but {name} on {P} meshes needs {P * V} "
                         f"({V} per mesh)")
    sched = kind.build(P, m, V, graph)
    return delay_weight_grads(sched) if delay_wgrad and not kind.zero_bubble else sched


def forward_only(graph: PipelineGraph, num_microbatches: int, placement: tuple[int, ...] | None = None) -> Schedule:
    """Evaluation: each mesh runs its stages in model order, F0..F(m-1) on each (no backward).

    Deadlock-free by construction: a stage's inputs come from earlier stages, which every mesh
    runs first; `validate.dry_run` of the lowered schedule is empty (tests check it).
    """
    place = tuple(placement) if placement is not None else tuple(range(graph.num_stages))
    meshes = max(place) + 1
    acts = [[Action(_K.F, j, s) for s in range(graph.num_stages) if place[s] == p for j in range(num_microbatches)]
            for p in range(meshes)]
    return Schedule(graph, num_microbatches, acts, "forward-only", place)
