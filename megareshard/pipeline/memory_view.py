"""Peak activation memory per stage, measured and simulated, for `--pipeline-trace` and the end-of-run line.

Three numbers per stage (per mesh):

* ``activation_bytes``: the measured peak of bytes saved for backward (`memory.ActivationMeter`, first
  iteration), MAX over the stage's ranks;
* ``inflight_measured``: the most microbatches whose activations the stage held at once in the last
  iteration (from F until B, or until W under delayed weight gradients — W still reads the inputs),
  counted by the runtime (``last_stats['peak_inflight']``), MAX over the stage's ranks;
* ``inflight_simulated``: the same count from the simulator on the run's lowered schedule
  (`Timeline.peak_activations`, unit costs).

They go into the trace as one ``{"kind": "MEMORY", "stage": s, ...}`` record per stage (readers of the
timeline skip it), and into one summary line. For 1F1B the counts fall with the stage index (stage i
holds ``min(m, P − i)``): the first stage holds the most.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from .simulate import simulate

__all__ = ["inflight_per_stage", "simulated_inflight", "memory_records", "summary_line"]


def inflight_per_stage(ctx, stats: dict[str, int], device: torch.device) -> list[int]:
    """Every stage's measured peak in-flight microbatches (MAX over its ranks), on every rank. Collective."""
    vec = torch.zeros(ctx.pp_size, dtype=torch.float64, device=device)
    vec[ctx.pp_rank()] = float(stats.get("peak_inflight", 0))
    if dist.is_initialized() and ctx.world_size > 1:
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
    return [int(v) for v in vec.tolist()]


def simulated_inflight(runtime, num_microbatches: int) -> list[int]:
    """The simulator's peak in-flight microbatches per mesh for the schedule the runtime trains with (pure)."""
    return simulate(runtime.training_schedule(num_microbatches)).peak_activations


def memory_records(activation_bytes: Sequence[int], measured: Sequence[int],
                   simulated: Sequence[int]) -> list[dict[str, Any]]:
    """One MEMORY record per stage for the trace file."""
    return [{"stage": s, "kind": "MEMORY", "activation_bytes": int(b), "inflight_measured": int(n),
             "inflight_simulated": int(p)}
            for s, (b, n, p) in enumerate(zip(activation_bytes, measured, simulated))]


def summary_line(activation_bytes: Sequence[int], measured: Sequence[int], simulated: Sequence[int]) -> str:
    parts = [f"stage {s} {b / 2**20:.2f} MiB, {n}/{p}"
             for s, (b, n, p) in enumerate(zip(activation_bytes, measured, simulated))]
    return (" peak activations per pipeline stage (MiB saved for backward, MAX over the stage's ranks; "
            "microbatches in flight measured/simulated): " + " | ".join(parts))
