"""The search dimensions beyond a uniform layout (pure): uneven layer splits, per-stage meshes, and the
schedules that put several stages on a mesh — their stage counts and activation bounds before simulation.

* **Layer splits** (``--num-layers-per-stage``): the first stage holds the embedding, the last the
  output layer and the loss (``2·b·s·h·V`` forward FLOPs: at a large vocabulary several layers' worth).
  `balanced_split` moves layers off the heavy stages: the split whose slowest stage is fastest,
  every stage keeping at least one layer (a bisection over the candidate maxima).
* **Per-stage meshes** (``--stage-layouts``): every stage keeps its block of ``n`` ranks but picks its
  own tp (dp = n / tp). `stage_layout_variants` varies the first and the last stage's tp around a
  uniform layout's (halved, kept, doubled): the stages whose memory and time differ from the rest.
  The global microbatch is micro batch × the largest dp, so a stage of smaller dp gives each rank
  proportionally more samples; the tps of one layout must be multiples of the smallest.
* **Virtual stages and live activations**: the schedule's kind says which V it runs with
  (`ScheduleKind.virtual_options`: interleaved-1f1b and eager-interleaved-1f1b every V dividing
  layers / pp, Megatron's ``--num-layers-per-virtual-pipeline-stage`` = layers / (pp·V); zbv two;
  the others one) and bounds each mesh's live (stage, microbatch) activations before the simulator
  measures them (`ScheduleKind.live_bound`); a kind without a bound is refused, by name.
"""
from __future__ import annotations

from typing import Sequence

from ..pipeline.schedules import get_schedule

__all__ = ["balanced_split", "stage_layout_variants", "virtual_options", "live_bound"]


def balanced_split(num_layers: int, pp: int, per_layer: float, extra: Sequence[float]) -> tuple[int, ...]:
    """Layers per stage minimising the slowest stage's ``layers·per_layer + extra[i]`` (each stage >= 1 layer).

    Ties keep layers on the earlier stages. Needs ``pp <= num_layers`` and ``per_layer > 0``.
    """
    if pp > num_layers or pp < 1 or per_layer <= 0 or len(extra) != pp:
        raise ValueError(f"balanced_split: need 1 <= pp {pp} <= layers {num_layers}, per-layer cost {per_layer} > 0 "
                         f"and one extra per stage (got {len(extra)})")

    def capacity(t: float) -> list[int] | None:
        caps = [int((t - e) / per_layer + 1e-9) for e in extra]
        return caps if min(caps) >= 1 and sum(caps) >= num_layers else None

    cands = sorted({k * per_layer + e for e in extra for k in range(1, num_layers + 1)})
    lo, hi = 0, len(cands) - 1
    while lo < hi:  # the smallest candidate maximum that fits every layer
        mid = (lo + hi) // 2
        if capacity(cands[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    caps = capacity(cands[lo])
    assert caps is not None
    split = list(caps)
    excess = sum(split) - num_layers
    while excess > 0:  # take the surplus from the most loaded stages, latest first
        i = max(range(pp), key=lambda j: (split[j] * per_layer + extra[j] if split[j] > 1 else -1.0, j))
        split[i] -= 1
        excess -= 1
    return tuple(split)


def stage_layout_variants(tp: int, pp: int, ranks_per_stage: int, allowed_tp: Sequence[int]
                          ) -> list[tuple[tuple[int, int], ...]]:
    """Per-stage (tp, dp) layouts near a uniform one: the first and last stage's tp halved, kept or doubled
    (among `allowed_tp`, dividing the stage's ranks), the middle stages' kept; the uniform layout excluded."""
    if pp < 2:
        return []
    near = [t for t in (tp // 2, tp, 2 * tp) if t >= 1 and t in allowed_tp and ranks_per_stage % t == 0]
    out = []
    for a in near:
        for c in near:
            if a == tp and c == tp:
                continue
            tps = [a] + [tp] * (pp - 2) + [c]
            low = min(tps)
            if any(t % low for t in tps):
                continue
            out.append(tuple((t, ranks_per_stage // t) for t in tps))
    return out


def virtual_options(name: str, pp: int, num_layers: int, microbatches: int, max_v: int = 4) -> list[int]:
    """Stages per mesh V that schedule `name` can run with (`ScheduleKind.virtual_options`)."""
    return get_schedule(name).virtual_options(pp, num_layers, microbatches, max_v)


def live_bound(name: str, delay_wgrad: bool, pp: int, microbatches: int, v: int) -> list[int]:
    """Per mesh, an upper bound of the live (stage, microbatch) activations (chunk activations when v > 1): the
    kind's own (`ScheduleKind.live_bound`); ValueError naming a kind that gives none, or a V it cannot hold."""
    kind = get_schedule(name)
    kind.stages(v)  # a V the kind holds
    return kind.live(pp, microbatches, v, delay_wgrad)
