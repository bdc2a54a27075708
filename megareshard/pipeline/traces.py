"""A pipeline run's measured timeline (``--pipeline-trace``): each stage's records gathered on rank 0 and written
as the JSON list ``tools/plot_schedule.py --trace`` draws (records come from `hooks.TraceHook`)."""
from __future__ import annotations

import json
from typing import Any

import torch.distributed as dist

from ..parallel import ParallelContext

__all__ = ["gather_trace", "write_trace"]


def gather_trace(ctx: ParallelContext, trace: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Collect each stage's trace (from its tp0 dp0 rank) on global rank 0, times from 0.

    Collective over the default group. Returns the merged trace on rank 0, None elsewhere.
    """
    mine = trace if ctx.tp_rank() == 0 and ctx.dp_rank() == 0 else []
    if not dist.is_initialized():
        gathered = [mine]
    else:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if dist.get_rank() != 0:
            return None
    recs = [r for part in gathered for r in (part or [])]
    if not recs:
        return []
    t0 = min(r["start"] for r in recs)
    return sorted(({**r, "start": r["start"] - t0, "end": r["end"] - t0} for r in recs),
                  key=lambda r: (r["stage"], r["start"]))


def write_trace(path: str, records: list[dict[str, Any]]) -> None:
    """JSON list for ``tools/plot_schedule.py --trace``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(records, f)
