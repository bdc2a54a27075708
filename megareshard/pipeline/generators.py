"""Schedule generators, one registry (`REGISTRY`: name -> `ScheduleKind`) read by the arguments,
the benchmarks, the planner and the tests.

**One stage per mesh** — gpipe, 1f1b, eager-1f1b, each optionally with delayed W. All three
are one shape: stage i runs `k_i` forwards before its first backward, then
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

**Virtual stages** — a mesh runs several stages (model chunks); stage order is model order.

* `interleaved-1f1b` (Narayanan et al., "Efficient Large-Scale Language Model Training on
  GPU Clusters Using Megatron-LM"): mesh p holds stages p, p+P, …, p+(V−1)P. Microbatches
  go in groups of P through each chunk in turn; mesh p runs Megatron's warm-up of
  ``2(P−p−1) + (V−1)P`` forwards (all of them when m = P), then one forward / one backward,
  then the remaining backwards (backwards visit the chunks in reverse). Megatron requires m to be a multiple of P; so do we.
* `eager-interleaved-1f1b`: the same with the paper's eager warm-up: ``P−p−1`` more forwards
  (what eager-1f1b adds to 1f1b), so a send leaves earlier and compute hides it.
* `zb-h1` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): one stage per mesh, the
  backward split into I and W; a list scheduler with unit F = I = W runs, on each idle mesh,
  an I if one is ready (the critical path), else an F if fewer than ``P−p`` activations are live
  (1F1B's memory), else the oldest pending W — W fills what was 1F1B's bubble.
* `zbv` (the same paper's V-shaped placement): 2P stages, mesh p holds stages p and
  2P−1−p (the turn at mesh P−1 is a local hand-off); the same list scheduler with at most 2P
  live chunk activations per mesh (1F1B's memory, chunks being half a stage).

Zero-bubble schedules are I/W schedules by definition (`delay_wgrad` is implied). The
runtime executes every registered kind (`RUNTIME_SCHEDULES`): a rank holds the model chunks
of its mesh's stages (`runtime.py`, `chunks.py`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from .schedule import Action, ActionKind, PipelineGraph, Schedule, ScheduleError

__all__ = ["REGISTRY", "SCHEDULES", "RUNTIME_SCHEDULES", "WARMUP_SCHEDULES", "forward_only", "ScheduleKind", "generate", "forwards_before_first_backward",
           "delay_weight_grads", "placement_of"]

_K = ActionKind


@dataclass(frozen=True)
class ScheduleKind:
    """One registered schedule."""

    name: str
    """Its name (`--pipeline-schedule`)."""
    build: Callable[[int, int, int, PipelineGraph], Schedule]
    """(meshes P, microbatches m, stages per mesh V, graph) -> compute-only schedule."""
    stages_per_mesh: int | None
    """1 (one stage per mesh), a fixed number (zbv: 2), or None (interleaved: the V asked for)."""
    zero_bubble: bool = False
    """An I/W schedule by definition (delayed W implied)."""
    runtime: bool = False
    """The pipeline runtime executes it today."""
    microbatch_multiple_of_pp: bool = False
    """m must be a multiple of the number of meshes (Megatron's rule for interleaving)."""


# ---- one stage per mesh ------------------------------------------------------------------------
def _k_gpipe(P: int, m: int, i: int) -> int:
    return m


def _k_1f1b(P: int, m: int, i: int) -> int:
    return min(m, P - i)


def _k_eager(P: int, m: int, i: int) -> int:
    return min(m, 2 * (P - i) - 1)


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


def _warmup_builder(warm: Callable[[int, int, int], int], name: str):
    def build(P: int, m: int, V: int, graph: PipelineGraph) -> Schedule:
        return Schedule(graph, m, [_stage_order(warm(P, m, i), m, i) for i in range(P)], name)
    return build


# ---- interleaved (virtual stages) ----------------------------------------------------------------
def _interleaved(eager: bool, name: str):
    def build(P: int, m: int, V: int, graph: PipelineGraph) -> Schedule:
        if not eager:
            return _interleaved_programs(P, m, V, graph, name, [0] * P)
        # eager: up to P - p - 1 more warm-up forwards on mesh p; an extra forward of a later chunk needs the
        # previous chunk's forward from the last mesh, so where the extras would deadlock they shrink until
        # the program provably runs (the dry run of the validator decides)
        from .lowering import lower
        from .validate import dry_run

        extra = [P - p - 1 for p in range(P)]
        while True:
            sched = _interleaved_programs(P, m, V, graph, name, extra)
            stuck = dry_run(lower(sched))
            if not stuck:
                return sched
            shrink = [p for p, _, _, _ in stuck if extra[p] > 0]
            if not shrink:  # pragma: no cover - with no extras this is Megatron's schedule, which runs
                raise ScheduleError(f"{name}: no eager warm-up runs for P={P}, m={m}, V={V}")
            for p in set(shrink):
                extra[p] -= 1
    return build


def _interleaved_programs(P: int, m: int, V: int, graph: PipelineGraph, name: str, extra: list[int]) -> Schedule:
    """Mesh programs of an interleaved schedule with `extra[p]` forwards added to mesh p's warm-up."""
    N = m * V  # (stage, microbatch) pairs per mesh

    def unit(k: int, p: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(k, P * V)
        v = within // P if forward else V - 1 - within // P
        return v * P + p, group * P + within % P

    out = []
    for p in range(P):
        # Megatron's warm-up, then its steady "one forward, one backward": warm-up + 1 forwards precede
        # the first backward (all of them when m = P)
        warm = N if m == P else min(N, 2 * (P - p - 1) + (V - 1) * P + 1 + extra[p])
        acts = [Action(_K.F, mb, st) for st, mb in (unit(k, p, True) for k in range(warm))]
        nf = warm
        for nb in range(N):
            st, mb = unit(nb, p, False)
            acts.append(Action(_K.B, mb, st))
            if nf < N:
                st, mb = unit(nf, p, True)
                acts.append(Action(_K.F, mb, st))
                nf += 1
        out.append(acts)
    return Schedule(graph, m, out, name, placement_of(name, P, V))


# ---- zero bubble (list scheduler) ----------------------------------------------------------------
def _zero_bubble(name: str, limit: Callable[[int, int], int]):
    def build(P: int, m: int, V: int, graph: PipelineGraph) -> Schedule:
        place = placement_of(name, P, V)
        S = graph.num_stages
        stages_of = [[s for s in range(S) if place[s] == p] for p in range(P)]
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
        return Schedule(graph, m, out, name, place)
    return build


def placement_of(name: str, P: int, V: int = 1) -> tuple[int, ...]:
    """Mesh of every stage for schedule `name` on P meshes (V stages per mesh where it applies)."""
    kind = _lookup(name)
    if kind.stages_per_mesh == 1:
        return tuple(range(P))
    if name == "zbv":
        return tuple(range(P)) + tuple(reversed(range(P)))
    return tuple(s % P for s in range(P * V))


REGISTRY: dict[str, ScheduleKind] = {k.name: k for k in (
    ScheduleKind("gpipe", _warmup_builder(_k_gpipe, "gpipe"), 1, runtime=True),
    ScheduleKind("1f1b", _warmup_builder(_k_1f1b, "1f1b"), 1, runtime=True),
    ScheduleKind("eager-1f1b", _warmup_builder(_k_eager, "eager-1f1b"), 1, runtime=True),
    ScheduleKind("interleaved-1f1b", _interleaved(False, "interleaved-1f1b"), None, runtime=True,
                 microbatch_multiple_of_pp=True),
    ScheduleKind("eager-interleaved-1f1b", _interleaved(True, "eager-interleaved-1f1b"), None, runtime=True,
                 microbatch_multiple_of_pp=True),
    ScheduleKind("zb-h1", _zero_bubble("zb-h1", lambda P, p: P - p), 1, zero_bubble=True, runtime=True),
    ScheduleKind("zbv", _zero_bubble("zbv", lambda P, p: 2 * P), 2, zero_bubble=True, runtime=True),
)}
SCHEDULES: tuple[str, ...] = tuple(REGISTRY)
"""Every registered schedule."""
RUNTIME_SCHEDULES: tuple[str, ...] = tuple(n for n, k in REGISTRY.items() if k.runtime)
"""The schedules the pipeline runtime executes today."""
_WARMUP = {"gpipe": _k_gpipe, "1f1b": _k_1f1b, "eager-1f1b": _k_eager}
WARMUP_SCHEDULES: tuple[str, ...] = tuple(_WARMUP)
"""The one-stage-per-mesh warm-up schedules (`forwards_before_first_backward` knows their live activations)."""


def _lookup(name: str) -> ScheduleKind:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; available: {', '.join(SCHEDULES)}") from None


def forwards_before_first_backward(name: str, num_stages: int, num_microbatches: int,
                                   stage: int) -> int:
    """`k_i` of the module docstring (one-stage-per-mesh schedules); the stage's peak live activations."""
    if name not in _WARMUP:
        _lookup(name)
        raise ValueError(f"forwards_before_first_backward: {name!r} is not a warm-up schedule "
                         f"({', '.join(_WARMUP)}); simulate it for its peak activations")
    return _WARMUP[name](num_stages, num_microbatches, stage)


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


def generate(name: str, num_stages: int, num_microbatches: int, delay_wgrad: bool = False,
             graph: PipelineGraph | None = None, virtual_stages: int | None = None) -> Schedule:
    """A compute-only schedule (F/B, or F/I/W when `delay_wgrad` or a zero-bubble kind); `lower()` adds comms.

    `num_stages` is the number of meshes (pipeline-parallel size P). Virtual-stage kinds put
    ``P × V`` stages on them: V = `virtual_stages` for the interleaved kinds (default 2), 2 for
    zbv. `graph` defaults to the plain chain of all stages; skip edges only add dependencies.
    """
    kind = _lookup(name)
    P, m = num_stages, num_microbatches
    if P < 1 or m < 1:
        raise ValueError(f"need num_stages >= 1 and num_microbatches >= 1, got "
                         f"num_stages={P}, num_microbatches={m}")
    V = kind.stages_per_mesh or (virtual_stages if virtual_stages is not None else 2)
    if kind.stages_per_mesh and virtual_stages not in (None, kind.stages_per_mesh):
        raise ValueError(f"schedule {name!r} puts {kind.stages_per_mesh} stage(s) on each mesh, not {virtual_stages}")
    if V < 1:
        raise ValueError(f"need at least one stage per mesh, got {V}")
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
