"""Zero bubble (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): zb-h1 and zbv.

* `zb-h1`: one stage per mesh, the backward split into I and W; a list scheduler with unit F = I = W runs,
  on each idle mesh, an I if one is ready (the critical path), else an F if fewer than ``P−p`` activations
  are live (1F1B's memory), else the oldest pending W — W fills what was 1F1B's bubble.
* `zbv` (the same paper's V-shaped placement): 2P stages, mesh p holds stages p and 2P−1−p (the turn at
  mesh P−1 is a local hand-off); the same list scheduler with at most 2P live chunk activations per mesh
  (1F1B's memory, chunks being half a stage).

Both are I/W schedules by definition (delayed W implied). The list scheduler's limit is also the live
bound: at most ``min(V·m, limit)`` activations per mesh.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from ..schedule import Action, ActionKind, PipelineGraph, Schedule, ScheduleError
from .kind import ScheduleKind, round_robin

__all__ = ["ZB_H1", "ZBV", "v_shape"]

_K = ActionKind


def v_shape(P: int, V: int = 2) -> tuple[int, ...]:
    """zbv's placement: stages 0..P−1 down the meshes, P..2P−1 back up (mesh p holds p and 2P−1−p)."""
    return tuple(range(P)) + tuple(reversed(range(P)))


def _list_scheduler(name: str, place: Callable[[int, int], tuple[int, ...]], limit: Callable[[int, int], int]):
    def build(P: int, m: int, V: int, graph: PipelineGraph) -> Schedule:
        placement = place(P, V)
        S = graph.num_stages
        stages_of = [[s for s in range(S) if placement[s] == p] for p in range(P)]
        nf, ni = [0] * S, [0] * S
        fdone: dict[tuple[int, int], int] = {}
        idone: dict[tuple[int, int], int] = {}
        pend: list[deque[Action]] = [deque() for _ in range(P)]
        live = [0] * P
        busy_until = [0] * P
        out: list[list[Action]] = [[] for _ in range(P)]
        t, left = 0, 3 * S * m
        while left:
            for p in range(P):
                if busy_until[p] > t:
                    continue
                pick = None
                for s in sorted(stages_of[p], reverse=True):  # I first, later stages first (critical path)
                    mb = ni[s]
                    if mb < m and fdone.get((s, mb), t + 1) <= t and all(
                            idone.get((e.dst, mb), t + 1) <= t for e in graph.out_edges(s)):
                        pick = Action(_K.I, mb, s)
                        ni[s] += 1
                        pend[p].append(Action(_K.W, mb, s))
                        break
                if pick is None and live[p] < limit(P, p):
                    ready = [s for s in stages_of[p] if nf[s] < m and all(
                        fdone.get((e.src, nf[s]), t + 1) <= t for e in graph.in_edges(s))]
                    if ready:
                        s = min(ready, key=lambda x: (nf[x], -x))
                        pick = Action(_K.F, nf[s], s)
                        nf[s] += 1
                        live[p] += 1
                if pick is None and pend[p]:
                    pick = pend[p].popleft()
                    live[p] -= 1
                if pick is None:
                    continue
                out[p].append(pick)
                busy_until[p] = t + 1
                left -= 1
                (fdone if pick.kind == _K.F else idone if pick.kind == _K.I else {})[(pick.stage, pick.mb)] = t + 1
            t += 1
            if t > 100 * (3 * S * m + P):  # pragma: no cover - every step makes progress or waits on one that does
                raise ScheduleError(f"{name}: the list scheduler made no progress (P={P}, m={m})")
        return Schedule(graph, m, out, name, placement)
    return build


def _kind(name: str, stages_per_mesh: int, place: Callable[[int, int], tuple[int, ...]],
          limit: Callable[[int, int], int]) -> ScheduleKind:
    def live_bound(P: int, m: int, V: int, delay_wgrad: bool) -> list[int]:
        return [min(V * m, limit(P, p)) for p in range(P)]

    return ScheduleKind(name, _list_scheduler(name, place, limit), stages_per_mesh, live_bound, placement=place,
                        zero_bubble=True)


ZB_H1 = _kind("zb-h1", 1, round_robin, lambda P, p: P - p)
ZBV = _kind("zbv", 2, v_shape, lambda P, p: 2 * P)
