"""The pipeline's makespan by simulation, as the search scores a candidate (pure).

``_pipeline`` lowers a schedule (``_lowered``, cached per shape) and simulates it under the stages' F/B/W
times, the per-action overhead, the posting costs and the boundary transfers (``_edge_arg``), extrapolating
long runs from steady-state simulations; ``pipeline_makespan`` is its public form for P equal stages.
"""
from __future__ import annotations

import functools
import math
from typing import Any

from ..pipeline.generators import generate
from ..pipeline.lowering import lower
from ..pipeline.schedules import get_schedule
from ..pipeline.simulate import Costs, simulate

__all__ = ["pipeline_makespan"]


@functools.lru_cache(maxsize=512)
def _lowered(name: str, P: int, m: int, dw: bool, v: int | None) -> Any:
    """The schedule lowered with its communication (one per shape: the search simulates it under many costs)."""
    return lower(generate(name, P, m, dw, virtual_stages=v))


def _pipeline(name: str, dw: bool, P: int, m: int, f: tuple[float, ...], b: tuple[float, ...],
              edge: float | tuple[tuple[str, float], ...], cache: dict[tuple, tuple[float, Any]],
              v: int = 1, overhead: float = 0.0, w: tuple[float, ...] | None = None,
              post: tuple[float, float] = (0.0, 0.0)) -> tuple[float, Any]:
    """(makespan for m microbatches, the timeline it was taken from): simulated, extrapolated in m. Under
    delayed weight gradients a stage's B splits into W = `w` (default: half of B) and I = B − W. Every compute
    action (F, B, and I and W each under delayed weight gradients) also takes `overhead` seconds, and posting
    a send or a receive `post` = (send, receive) seconds of its program."""
    w = w if w is not None else tuple(x / 2 for x in b)
    key = (name, dw, P, m, f, b, edge, v, overhead, w, post)
    if key not in cache:
        costs = Costs(f=[x + overhead for x in f], b=[x + overhead for x in b],
                      i=[x - y + overhead for x, y in zip(b, w)], w=[y + overhead for y in w],
                      comm=edge if isinstance(edge, float) else dict(edge), send_post=post[0], recv_post=post[1])
        kind = get_schedule(name)

        def run(n: int):
            return simulate(_lowered(name, P, n, dw, v if kind.stages_per_mesh is None else None), costs=costs)

        step = P if kind.microbatch_multiple_of_pp else 4
        m1 = step * math.ceil((3 * P + 2) / step)  # past every schedule's warm-up transient
        if P == 1 or m <= m1 + 2 * step or (m - m1) % step:
            tl = run(m)
            cache[key] = (tl.makespan, tl)
        else:
            t1, t2, tl = run(m1).makespan, run(m1 + step).makespan, run(m1 + 2 * step)
            if abs((tl.makespan - t2) - (t2 - t1)) > 1e-9 * tl.makespan:  # not yet linear: simulate it all
                tl = run(m)
                cache[key] = (tl.makespan, tl)
            else:
                cache[key] = (tl.makespan + (m - m1 - 2 * step) * (tl.makespan - t2) / step, tl)
    return cache[key]


def pipeline_makespan(schedule: str, delay_wgrad: bool, P: int, m: int, forward_s: float, backward_s: float,
                      wgrad_s: float, edge_s: float, overhead_s: float, post_s: tuple[float, float] = (0.0, 0.0)
                      ) -> float:
    """Simulated seconds of m microbatches through P equal stages of one mesh each (what `search._simulate`
    scores a candidate's pipeline with): F = `forward_s`, B = `backward_s` (I = B − W and W = `wgrad_s` under
    delayed weight gradients), every action `overhead_s` more, every stage transfer `edge_s`, posting a send and
    a receive `post_s` of the program."""
    return _pipeline(schedule, delay_wgrad, P, m, (forward_s,) * P, (backward_s,) * P, edge_s, {}, 1, overhead_s,
                     (wgrad_s,) * P, post_s)[0]


def _edge_arg(edges: dict[str, float]) -> float | tuple[tuple[str, float], ...]:
    return edges["*"] if "*" in edges else tuple(sorted(edges.items()))
