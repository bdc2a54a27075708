"""Pipeline start-up checks and the tied-embedding reduction across stage layouts.

The stage layouts themselves (`StageLayout`, `split_layers`, `hidden_spec`, `stage_layouts`,
`stage_mesh`) live in `megareshard.model_spec.placement`, neutral ground the model specs share, and are
re-exported here; building a stage's module is its model spec's job (`ModelSpec.build_model`).
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from ..config_fields import ConfigError
from ..parallel import ParallelContext, Topology
from ..model_spec.placement import StageLayout, hidden_spec, split_layers, stage_mesh, stage_tp_dp
from ..model_spec.placement import stage_layouts as _layouts_on
from ..resharding.strategies import get_strategy, strategy_names
from .generators import placement_of
from .schedules import get_schedule, schedule_names

if TYPE_CHECKING:  # annotations only: the pipeline does not depend on the command-line module
    from ..arguments import Config

__all__ = ["StageLayout", "split_layers", "stage_mesh", "stage_tp_dp", "hidden_spec", "stage_layouts",
           "check_pipeline_config", "reduce_tied_grad_across_layouts", "virtual_stages", "stage_placement"]


def virtual_stages(cfg: Config) -> int:
    """Stages per pipeline rank of a validated config: the schedule's own count (zbv: 2), else the virtual
    stages Megatron's flags give (1: none). Pure: what `arguments.resolve_virtual_stages` checked."""
    pl = cfg.pipeline
    kind = get_schedule(pl.pipeline_schedule)
    if kind.stages_per_mesh is not None:
        return kind.stages_per_mesh
    if pl.num_layers_per_virtual_pipeline_stage:
        return max(1, cfg.model.num_layers // (cfg.pp * pl.num_layers_per_virtual_pipeline_stage))
    return pl.virtual_pipeline_model_parallel_size or pl.num_virtual_stages_per_pipeline_rank or 1


def stage_placement(cfg: Config, pp: int) -> tuple[int, ...]:
    """The mesh (pp rank) of every stage: stage s on mesh s, or the schedule's virtual placement —
    Megatron-LM's interleaving puts virtual stage ``v·P + p`` on mesh p; zbv the V shape."""
    v = virtual_stages(cfg)
    return tuple(range(pp)) if v == 1 else placement_of(cfg.pipeline.pipeline_schedule, pp, v)


def stage_layouts(cfg: Config, topology: Topology) -> list[StageLayout]:
    """Every stage's layout for this run: ``pp × V`` stages with virtual stages, each on the mesh
    `stage_placement` gives it (the `[s, b, h]` default of `model_spec.placement.stage_layouts`)."""
    return _layouts_on(cfg, topology, stage_placement(cfg, topology.pp))


def check_pipeline_config(cfg: Config, world_size: int) -> None:
    """Start-up validation of everything the pipeline needs, with the numbers in the message.

    Runs before any model or communicator is built, so a bad flag fails in milliseconds
    on every rank instead of deadlocking later.
    """
    pp, pl, t = cfg.pp, cfg.pipeline, cfg.training
    if pl.pipeline_schedule not in schedule_names():
        raise ConfigError(f"unknown --pipeline-schedule {pl.pipeline_schedule!r}; available: "
                          f"{', '.join(schedule_names())}")
    if pl.reshard_strategy not in strategy_names():
        raise ConfigError(f"unknown --reshard-strategy {pl.reshard_strategy!r}; available: "
                          f"{', '.join(strategy_names())}")
    if pl.reshard_chunks is not None and pl.reshard_chunks < 1:
        raise ConfigError(f"--reshard-chunks must be at least 1, got {pl.reshard_chunks}")
    v = virtual_stages(cfg)
    split_layers(cfg.model.num_layers, pp * v, pl.num_layers_per_stage,
                 None if v == 1 else f"pp {pp} × {v} virtual stages = {pp * v} stages")
    if not cfg.parallel.stage_layouts and world_size % (cfg.tp * pp):
        raise ConfigError(f"world size {world_size} is not divisible by tp {cfg.tp} × pp {pp}")
    dp = cfg.dp(world_size)
    if t.global_batch_size is None or t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(f"global batch {t.global_batch_size} is not divisible by micro batch "
                          f"{t.micro_batch_size} × dp {dp}")
    m = t.global_batch_size // (t.micro_batch_size * dp)
    if get_schedule(pl.pipeline_schedule).microbatch_multiple_of_pp and m % pp:
        raise ConfigError(f"--pipeline-schedule {pl.pipeline_schedule}: {m} microbatches are not a multiple of "
                          f"--pipeline-model-parallel-size {pp}: interleaving sends microbatches through the chunks "
                          "in groups of pp")
    if pp > 1 and m < pp:
        warnings.warn(f"{m} microbatch(es) for {pp} pipeline stages: the bubble is at least "
                      f"{(pp - 1) / (m + pp - 1):.0%} of the step; raise --global-batch-size to at least "
                      f"{pp * t.micro_batch_size * dp} to fill the pipeline", stacklevel=2)
    if pp > 1 and not get_strategy(pl.reshard_strategy).carries_data:
        warnings.warn(f"--reshard-strategy {pl.reshard_strategy} carries no data: stage inputs are undefined, "
                      "so the loss is meaningless (a communication bound for benchmarks)", stacklevel=2)


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
