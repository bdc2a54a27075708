"""Every rank executes rank 0's task order and senders: one collective agrees on many resharding plans."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:  # pragma: no cover
    from .plan import ReshardingPlan

__all__ = ["agree_on_orders"]


def agree_on_orders(plans: list["ReshardingPlan"]) -> list[list[tuple[int, int | None]]]:
    """Rank 0's task order and senders for each plan, on every rank: one object all-gather over the default
    group for all of them (collective; a pipeline agrees on every edge's plans at once, not one collective per
    `Resharder`). Schedulers with a time budget (dfs) may decide differently on different ranks; executing
    different orders would deadlock, so rank 0's decisions win. A plan for a different problem on some rank is
    an error on every rank, naming both."""
    def desc(plan):
        return (tuple(int(s) for s in plan.shape), repr(plan.src_mesh), str(plan.src_spec), repr(plan.dst_mesh),
                str(plan.dst_spec), plan.strategy,
                sorted((t.index, tuple((s.start, s.stop) for s in t.slice)) for t in plan.tasks))

    mine = [(desc(p), [(t.index, t.sender) for t in p.tasks]) for p in plans]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    for r, theirs in enumerate(gathered):
        if len(theirs) != len(mine):
            raise ValueError(f"rank {r} agreed on {len(theirs)} resharding plans, rank 0 on {len(gathered[0])}")
        for i, ((d, _), (d0, _)) in enumerate(zip(theirs, gathered[0])):
            if d != d0:
                raise ValueError(f"rank {r} built its Resharder from a plan for a different problem than rank 0 "
                                 f"(rank 0: shape {d0[0]} {d0[2]} -> {d0[4]} {d0[5]}; "
                                 f"rank {r}: shape {d[0]} {d[2]} -> {d[4]} {d[5]})")
    return [list(order) for _, order in gathered[0]]
