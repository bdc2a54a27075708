"""Schedule generators: gpipe, 1f1b, eager-1f1b, each optionally with delayed W.

All three are one shape: stage i runs `k_i` forwards before its first backward, then
alternates backward/forward, then drains the remaining backwards. Only `k_i` differs:

    gpipe       k_i = m                      (all F, then all B)
    1f1b        k_i = min(m, P - i)          (P-i-1 warm-up forwards + the first pair)
    eager-1f1b  k_i = min(m, 2(P - i) - 1)   (paper §4: forwards run early so that the
                                             compute of other microbatches sits between
                                             a send and the compute that waits for it)

`k_i` is also the stage's peak number of live activations (without delayed W).

Fewer microbatches than stages (m < P) is allowed for every schedule: `min(m, ...)`
simply caps the warm-up, the schedule degenerates towards GPipe and the bubble grows to
(P-1)/(m+P-1) as usual; nothing deadlocks (the validator proves it for P, m <= 12).

Delayed weight gradients (`delay_wgrad=True`): every B(mb) becomes I(mb), which runs
where B ran (its output is what the previous stage waits for, so it must not be
delayed), plus W(mb) pushed onto a FIFO queue. The rule that places W's: **before
each compute action that needs a receive** (an F with an incoming edge, an I with an
outgoing edge) pop and run the oldest queued W, and flush whatever is left at the end
of the step. That is where the stage would otherwise sit idle waiting for a tensor in
flight, and right after I the queued W runs while I's gradient is being sent (the
paper's backward weight delaying). W therefore always follows its own I, and at most
a couple of W's are pending at a time, which bounds the extra activation memory
(activations stay live until W: W still needs the layer inputs).
"""

from __future__ import annotations

from types import MappingProxyType

from collections import deque
from typing import Callable, Mapping

from .schedule import Action, ActionKind, PipelineGraph, Schedule, ScheduleError

__all__ = ["SCHEDULES", "generate", "forwards_before_first_backward", "delay_weight_grads"]


def _k_gpipe(P: int, m: int, i: int) -> int:
    return m


def _k_1f1b(P: int, m: int, i: int) -> int:
    return min(m, P - i)


def _k_eager(P: int, m: int, i: int) -> int:
    return min(m, 2 * (P - i) - 1)


_WARMUP: Mapping[str, Callable[[int, int, int], int]] = MappingProxyType({
    "gpipe": _k_gpipe,
    "1f1b": _k_1f1b,
    "eager-1f1b": _k_eager,
})
SCHEDULES: tuple[str, ...] = tuple(_WARMUP)
_PLANNED = ("interleaved",)


def forwards_before_first_backward(name: str, num_stages: int, num_microbatches: int,
                                   stage: int) -> int:
    """`k_i` of the module docstring; equals the stage's peak live activations."""
    return _lookup(name)(num_stages, num_microbatches, stage)


def _lookup(name: str) -> Callable[[int, int, int], int]:
    if name in _PLANNED:
        raise NotImplementedError(f"schedule {name!r} is planned but not implemented yet "
                                  f"(available: {', '.join(SCHEDULES)})")
    try:
        return _WARMUP[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; available: {', '.join(SCHEDULES)}") from None


def _stage_order(k: int, m: int, stage: int) -> list[Action]:
    """k forwards, then (B, F) pairs, then the remaining backwards, all in mb order."""
    acts = [Action(ActionKind.F, j, stage) for j in range(k)]
    nf = k
    for nb in range(m):
        acts.append(Action(ActionKind.B, nb, stage))
        if nf < m:
            acts.append(Action(ActionKind.F, nf, stage))
            nf += 1
    return acts


def delay_weight_grads(schedule: Schedule) -> Schedule:
    """Split each B into I + a queued W, placed by the rule in the module docstring."""
    if schedule.is_lowered:
        raise ScheduleError("delay_weight_grads works on compute-only schedules; "
                            "apply it before lower()")
    graph = schedule.graph
    out: list[list[Action]] = []
    for s, acts in enumerate(schedule.actions):
        has_in, has_out = bool(graph.in_edges(s)), bool(graph.out_edges(s))
        queue: deque[Action] = deque()
        new: list[Action] = []
        for a in acts:
            waits = (a.kind == ActionKind.F and has_in) or (
                a.kind in (ActionKind.B, ActionKind.I) and has_out)
            if waits and queue:
                new.append(queue.popleft())
            if a.kind == ActionKind.B:
                new.append(Action(ActionKind.I, a.mb, s, a.chunk))
                queue.append(Action(ActionKind.W, a.mb, s, a.chunk))
            else:
                new.append(a)
        new.extend(queue)
        out.append(new)
    return Schedule(graph, schedule.num_microbatches, out, schedule.name + "+dw")


def generate(name: str, num_stages: int, num_microbatches: int, delay_wgrad: bool = False,
             graph: PipelineGraph | None = None) -> Schedule:
    """A compute-only schedule (F/B, or F/I/W when `delay_wgrad`); `lower()` adds comms.

    `graph` defaults to the plain chain of `num_stages` stages; skip edges do not change
    the compute order (they only add dependencies, which these orders already satisfy
    because every stage runs microbatches in ascending order).
    """
    warm = _lookup(name)
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"need num_stages >= 1 and num_microbatches >= 1, got "
                         f"num_stages={num_stages}, num_microbatches={num_microbatches}")
    graph = graph if graph is not None else PipelineGraph(num_stages)
    if graph.num_stages != num_stages:
        raise ValueError(f"graph has {graph.num_stages} stages but num_stages={num_stages}")
    P, m = num_stages, num_microbatches
    acts = [_stage_order(warm(P, m, i), m, i) for i in range(P)]
    sched = Schedule(graph, m, acts, name)
    return delay_weight_grads(sched) if delay_wgrad else sched
