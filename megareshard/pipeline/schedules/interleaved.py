"""Virtual stages, interleaved: interleaved-1f1b and eager-interleaved-1f1b.

* `interleaved-1f1b` (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM"): mesh p holds stages p, p+P, …, p+(V−1)P. Microbatches go in groups of P through
  each chunk in turn; mesh p runs Megatron's warm-up of ``2(P−p−1) + (V−1)P`` forwards (all of them when
  m = P), then one forward / one backward, then the remaining backwards (backwards visit the chunks in
  reverse). Megatron requires m to be a multiple of P; so do we.
* `eager-interleaved-1f1b`: the same with the paper's eager warm-up: ``P−p−1`` more forwards (what
  eager-1f1b adds to 1f1b), so a send leaves earlier and compute hides it.

V is the user's (Megatron-LM's virtual pipeline flags). The live bound is the warm-up count + 1 (the
first backward's forward), + 1 under delayed weight gradients; all m·V when m = P.
"""
from __future__ import annotations

from ..lowering import lower
from ..schedule import Action, ActionKind, PipelineGraph, Schedule, ScheduleError
from ..validate import dry_run
from .kind import ScheduleKind, round_robin

__all__ = ["INTERLEAVED_1F1B", "EAGER_INTERLEAVED_1F1B"]

_K = ActionKind


def _warm(P: int, m: int, V: int, p: int, extra: int) -> int:
    """Forwards mesh p runs before its first backward: Megatron's warm-up + 1 (+ `extra`); all when m = P."""
    N = m * V
    return N if m == P else min(N, 2 * (P - p - 1) + (V - 1) * P + 1 + extra)


def _programs(P: int, m: int, V: int, graph: PipelineGraph, name: str, extra: list[int]) -> Schedule:
    """Mesh programs of an interleaved schedule with `extra[p]` forwards added to mesh p's warm-up."""
    N = m * V  # (stage, microbatch) pairs per mesh

    def unit(k: int, p: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(k, P * V)
        v = within // P if forward else V - 1 - within // P
        return v * P + p, group * P + within % P

    out = []
    for p in range(P):
        # Megatron's warm-up, then its steady "one forward, one backward"
        warm = _warm(P, m, V, p, extra[p])
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
    return Schedule(graph, m, out, name, round_robin(P, V))


def _build_plain(P: int, m: int, V: int, graph: PipelineGraph) -> Schedule:
    return _programs(P, m, V, graph, "interleaved-1f1b", [0] * P)


def _build_eager(P: int, m: int, V: int, graph: PipelineGraph) -> Schedule:
    """Up to P − p − 1 more warm-up forwards on mesh p; an extra forward of a later chunk needs the previous
    chunk's forward from the last mesh, so where the extras would deadlock they shrink until the program
    provably runs (the dry run of the validator decides)."""
    name = "eager-interleaved-1f1b"
    extra = [P - p - 1 for p in range(P)]
    while True:
        sched = _programs(P, m, V, graph, name, extra)
        stuck = dry_run(lower(sched))
        if not stuck:
            return sched
        shrink = [p for p, _, _, _ in stuck if extra[p] > 0]
        if not shrink:  # pragma: no cover - with no extras this is Megatron's schedule, which runs
            raise ScheduleError(f"{name}: no eager warm-up runs for P={P}, m={m}, V={V}")
        for p in set(shrink):
            extra[p] -= 1


def _live_bound(eager: bool):
    def bound(P: int, m: int, V: int, delay_wgrad: bool) -> list[int]:
        # all m·V live when m = P (nothing more under delayed W); else the warm-up (+ the eager extra, an upper
        # bound: the eager builder may shrink it) + 1 under delayed W
        return [m * V if m == P else _warm(P, m, V, p, P - p - 1 if eager else 0) + (1 if delay_wgrad else 0)
                for p in range(P)]
    return bound


INTERLEAVED_1F1B = ScheduleKind("interleaved-1f1b", _build_plain, None, _live_bound(False),
                                microbatch_multiple_of_pp=True)
EAGER_INTERLEAVED_1F1B = ScheduleKind("eager-interleaved-1f1b", _build_eager, None, _live_bound(True),
                                      microbatch_multiple_of_pp=True)
