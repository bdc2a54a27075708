"""The resolved run plan: every number a validated configuration implies and every registered object its flags
name, computed once and passed down.

`config_checks.validate` checks the flags (once, with the numbers in every message) and returns the
configuration with ``.plan`` = `resolve(cfg, world_size)`. What the trainer, the model specs and the pipeline
runtime need beyond the flags — dp, the microbatch count, virtual stages and where every stage sits, the layers
of every stage, the per-stage layouts, the samples an edge carries, the ZeRO stage, and the schedule kind,
resharding strategy and reshard scheduler themselves (not their names) — is read from the plan, never worked
out or looked up again; the pipeline runtime is built from a `PipelinePlan` alone (no command-line config
reaches it). Pure: no torch, no processes.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import Config
from .pipeline.plan import PipelinePlan
from .pipeline.schedules import ScheduleKind, get_schedule
from .resharding.schedulers import get_scheduler
from .resharding.strategies import get_strategy

__all__ = ["PipelinePlan", "RunPlan", "resolve", "virtual_stages", "data_parallel_size", "microbatch_count",
           "layers_per_stage"]


@dataclass(frozen=True)
class RunPlan:
    """A validated configuration on `world_size` ranks, resolved."""

    world_size: int
    tp: int
    pp: int
    dp: int
    """The data-parallel degree (with per-stage layouts the largest stage's)."""
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    virtual_stages: int
    """Stages per pipeline rank (1: none)."""
    pipeline: PipelinePlan
    auto_layout: str | None = None
    """What `--auto-layout` chose and why (None: the layout flags were given)."""
    zero_stage: int = 0
    """The ZeRO stage the run uses (--zero-stage, or what Megatron's spellings of it map to)."""
    stage_layouts: tuple[tuple[int, int], ...] | None = None
    """(tp, dp) of every pipeline stage with --stage-layouts (None: one layout for all)."""

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def local_micro_batch(self, stage_dp: int) -> int:
        """Samples per microbatch on a rank of a stage with `stage_dp` data-parallel ranks: per-stage layouts shard
        one global microbatch of micro batch × (the largest dp) samples over each stage's own dp."""
        return self.micro_batch_size * self.dp // stage_dp


def data_parallel_size(cfg: Config, world_size: int) -> int:
    """The dp degree on `world_size` ranks; with --stage-layouts the largest stage's (a global microbatch is micro
    batch × it). The one place it is computed: the plan holds it (``RunPlan.dp``)."""
    if cfg.parallel.stage_layouts:
        from .parallel.stage_topology import parse_stage_layouts

        return max(d for _, d in parse_stage_layouts(cfg.parallel.stage_layouts))
    return world_size // (cfg.tp * cfg.pp)


def microbatch_count(cfg: Config, world_size: int) -> int:
    """Microbatches per iteration: global batch / (micro batch × dp). The one place it is computed (the plan holds
    it: ``RunPlan.num_microbatches``; the data sampler and the pipeline read it there)."""
    t = cfg.training
    return t.global_batch_size // (t.micro_batch_size * data_parallel_size(cfg, world_size))


def virtual_stages(cfg: Config, kind: ScheduleKind) -> int:
    """Stages per pipeline rank of a validated config running `kind`: the schedule's own count (zbv: 2), else the
    virtual stages Megatron's flags give (1: none) — what `config_checks.resolve_virtual_stages` checked."""
    pl = cfg.pipeline
    if kind.stages_per_mesh is not None:
        return kind.stages_per_mesh
    if pl.num_layers_per_virtual_pipeline_stage:
        return max(1, cfg.model.num_layers // (cfg.pp * pl.num_layers_per_virtual_pipeline_stage))
    return pl.virtual_pipeline_model_parallel_size or pl.num_virtual_stages_per_pipeline_rank or 1


def layers_per_stage(cfg: Config, num_stages: int) -> tuple[int, ...]:
    """Layers of every stage: --num-layers-per-stage, or the even split the validation allowed."""
    if cfg.pipeline.num_layers_per_stage is not None:
        return tuple(int(x) for x in cfg.pipeline.num_layers_per_stage.split(","))
    return (cfg.model.num_layers // num_stages,) * num_stages


def resolve(cfg: Config, world_size: int, auto_layout: str | None = None) -> RunPlan:
    """The plan of a validated `cfg` on `world_size` ranks (called by `config_checks.validate`)."""
    pl, t = cfg.pipeline, cfg.training
    pp, dp = cfg.pp, data_parallel_size(cfg, world_size)
    kind = get_schedule(pl.pipeline_schedule)
    v = virtual_stages(cfg, kind)
    placement = tuple(range(pp)) if v == 1 else kind.placement(pp, v)
    m = microbatch_count(cfg, world_size)
    pipe = PipelinePlan(schedule=pl.pipeline_schedule, delay_wgrad=pl.delay_wgrad_compute,
                        strategy=pl.reshard_strategy, scheduler=pl.reshard_scheduler, chunks=pl.reshard_chunks,
                        num_microbatches=m, edge_batch=t.micro_batch_size * dp, placement=placement,
                        schedule_file=pl.pipeline_schedule_file, overlap_grad_reduce=cfg.memory.overlap_grad_reduce,
                        recv_posting=pl.pipeline_recv_posting, kind=kind,
                        strategy_impl=get_strategy(pl.reshard_strategy),
                        scheduler_impl=get_scheduler(pl.reshard_scheduler),
                        layers_per_stage=layers_per_stage(cfg, pp * v))
    stages = None
    if cfg.parallel.stage_layouts:
        from .parallel.stage_topology import parse_stage_layouts

        stages = tuple(tuple(x) for x in parse_stage_layouts(cfg.parallel.stage_layouts))
    return RunPlan(world_size=world_size, tp=cfg.tp, pp=pp, dp=dp, micro_batch_size=t.micro_batch_size,
                   global_batch_size=t.global_batch_size, num_microbatches=m, virtual_stages=v, pipeline=pipe,
                   auto_layout=auto_layout, zero_stage=cfg.memory.zero_stage, stage_layouts=stages)
