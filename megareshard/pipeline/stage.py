"""The run's stage layouts and the tied-embedding reduction across stage layouts.

The stage layouts themselves (`StageLayout`, `split_layers`, `hidden_spec`, `stage_layouts`,
`stage_mesh`) live in `megareshard.model_spec.placement`, neutral ground the model specs share, and are
re-exported here; building a stage's module is its model spec's job (`ModelSpec.build_model`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..parallel import ParallelContext, Topology
from ..model_spec.placement import StageLayout, hidden_spec, split_layers, stage_mesh, stage_tp_dp
from ..model_spec.placement import stage_layouts as _layouts_on

if TYPE_CHECKING:  # annotations only: the pipeline does not depend on the command-line module
    from ..config import Config

__all__ = ["StageLayout", "split_layers", "stage_mesh", "stage_tp_dp", "hidden_spec", "stage_layouts",
           "reduce_tied_grad_across_layouts"]


def stage_layouts(cfg: Config, topology: Topology) -> list[StageLayout]:
    """Every stage's layout for this run: ``pp × V`` stages with virtual stages, each on the mesh its resolved
    plan places it (``cfg.plan.pipeline.placement``; the `[s, b, h]` default of
    `model_spec.placement.stage_layouts`)."""
    return _layouts_on(cfg, topology, cfg.plan.pipeline.placement)


def reduce_tied_grad_across_layouts(weight: torch.Tensor, ctx: ParallelContext, vocab_size: int) -> None:
    """Tied word embedding between a first and a last stage of *different* layouts: one gradient for both.

    Each copy is vocab-parallel over its own stage's tp (with its own padding) and each rank's
    gradient covers only its dp shard of the batch. One all-reduce over the first + last
    stage's ranks (``ctx.embedding_group``) of a full ``[vocab, h]`` fp32 buffer, in which
    every rank writes its own vocabulary rows divided by its stage's dp, gives every rank
    ``mean_dp(first) + mean_dp(last)`` — the gradient of the single tied weight; each rank
    keeps its own rows (padding rows zero). The stage's dp reduction that follows averages
    identical values, so it changes nothing. Same numbers as the single-process tied model.
    """
    import torch.distributed as dist

    g = weight.grad
    rows = g.shape[0]
    start = ctx.tp_rank() * rows
    n = max(0, min(vocab_size - start, rows))
    full = torch.zeros(vocab_size, *g.shape[1:], dtype=torch.float32, device=g.device)
    if n:
        full[start:start + n] = g[:n].float() / ctx.dp_size
    dist.all_reduce(full, group=ctx.embedding_group)
    g.zero_()
    if n:
        g[:n] = full[start:start + n].to(g.dtype)
