"""One stage per mesh: gpipe, 1f1b, eager-1f1b.

All three are one shape: stage i runs `k_i` forwards before its first backward, then alternates
backward/forward, then drains the remaining backwards. Only `k_i` differs:

    gpipe       k_i = m                      (all F, then all B)
    1f1b        k_i = min(m, P - i)          (P-i-1 warm-up forwards + the first pair)
    eager-1f1b  k_i = min(m, 2(P - i) - 1)   (paper §4: forwards run early so that the
                                             compute of other microbatches sits between
                                             a send and the compute that waits for it)

`k_i` is also the stage's peak number of live activations; the live bound adds one under delayed
weight gradients (an activation stays live until its W; the tests check the bound against the
simulated peak).

Fewer microbatches than stages (m < P) is allowed: `min(m, ...)` caps the warm-up, the schedule
degenerates towards GPipe and the bubble grows to (P-1)/(m+P-1) as usual; nothing deadlocks (the
validator proves it for P, m <= 12). With virtual stages, 1f1b and eager-1f1b run as their
interleaved twins (Megatron-LM interleaves whenever there are virtual stages); gpipe refuses them.
"""
from __future__ import annotations

from typing import Callable

from ..schedule import Action, ActionKind, PipelineGraph, Schedule
from .kind import ScheduleKind

__all__ = ["GPIPE", "ONE_F_ONE_B", "EAGER_1F1B", "warmup_kind"]

_K = ActionKind


def _stage_order(k: int, m: int, stage: int) -> list[Action]:
    """k forwards, then (B, F) pairs, then the remaining backwards, all in mb order."""
    acts = [Action(_K.F, j, stage) for j in range(k)]
    nf = k
    for nb in range(m):
        acts.append(Action(_K.B, nb, stage))
        if nf < m:
            acts.append(Action(_K.F, nf, stage))
            nf += 1
    return acts


def warmup_kind(name: str, warm: Callable[[int, int, int], int], **facts) -> ScheduleKind:
    """The one-stage-per-mesh kind whose stage i runs ``warm(P, m, i)`` forwards before its first backward."""
    def build(P: int, m: int, V: int, graph: PipelineGraph) -> Schedule:
        return Schedule(graph, m, [_stage_order(warm(P, m, i), m, i) for i in range(P)], name)

    def live_bound(P: int, m: int, V: int, delay_wgrad: bool) -> list[int]:
        return [min(m, warm(P, m, p)) + (1 if delay_wgrad else 0) for p in range(P)]

    return ScheduleKind(name, build, 1, live_bound, warmup=warm, **facts)


GPIPE = warmup_kind("gpipe", lambda P, m, i: m, search_delay_wgrad=False)
ONE_F_ONE_B = warmup_kind("1f1b", lambda P, m, i: min(m, P - i), interleaved_twin="interleaved-1f1b")
EAGER_1F1B = warmup_kind("eager-1f1b", lambda P, m, i: min(m, 2 * (P - i) - 1),
                         interleaved_twin="eager-interleaved-1f1b")
