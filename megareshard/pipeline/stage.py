"""One pipeline stage: its layers, its mesh, the layout of its boundary tensors, its model part.

docs/design.md §1: a stage is (its layers, its mesh, the layout of every tensor it consumes
and produces). Here the mesh of stage ``i`` is the ranks with pp coordinate ``i`` laid
out as a 2-D ``dp × tp`` grid (axis 0 = dp, axis 1 = tp) with each rank's host taken
from the Topology, and the GPT's hidden states ``[s, b, h]`` are

* ``R,S0,R``  — batch over dp, replicated over tp (plain tensor parallelism), or
* ``S1,S0,R`` — sequence over tp as well (sequence parallelism),

so the resharding planner sees exactly which slice every rank holds and needs. The
*global* hidden tensor of one microbatch is ``[seq, micro_batch × dp, hidden]``: every
stage processes the same global microbatch, each sharded over its own dp.

Everything here is pure (no process groups) except `build_stage_model`, which builds
this rank's part of the GPT.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..arguments import Config, ConfigError, virtual_stages_per_rank
from ..parallel import ParallelContext, Topology
from ..resharding import Mesh, ShardingSpec
from .generators import REGISTRY, RUNTIME_SCHEDULES, SCHEDULES, placement_of
from .meshes import stage_mesh, stage_tp_dp
from .schedule import PipelineGraph

__all__ = ["StageLayout", "split_layers", "stage_mesh", "stage_tp_dp", "hidden_spec", "stage_layouts",
           "check_pipeline_config", "build_stage_model", "hidden_global_shape", "virtual_stages", "stage_placement"]

_EXECUTABLE_STRATEGIES = ("sendrecv", "allgather", "broadcast", "signal")


@dataclass(frozen=True)
class StageLayout:
    """Where one stage lives and how its boundary hidden states are laid out."""

    stage: int
    layer_range: tuple[int, int]  # global layers [start, stop)
    mesh: Mesh  # dp × tp ranks of this stage
    hidden_spec: ShardingSpec  # layout of the [s, b, h] hidden states it receives and sends

    @property
    def num_layers(self) -> int:
        return self.layer_range[1] - self.layer_range[0]

    def describe(self) -> str:
        a, b = self.layer_range
        return (f"stage {self.stage}: layers {a}..{b - 1} on mesh {self.mesh} "
                f"(ranks {list(self.mesh.flat_ranks)}), hidden {self.hidden_spec}")


def split_layers(num_layers: int, num_stages: int, per_stage: str | None = None,
                 what: str | None = None) -> list[tuple[int, int]]:
    """Global layer ranges per stage: ``--num-layers-per-stage`` (comma list) or an even split.

    Every stage needs at least one layer: a stage without layers would still pay a full
    resharding in and out for nothing. ``what`` names the stage count in messages (default
    ``--pipeline-model-parallel-size N``; virtual stages: ``pp P × V virtual stages``).
    """
    what = what or f"--pipeline-model-parallel-size {num_stages}"
    if num_stages < 1:
        raise ConfigError(f"--pipeline-model-parallel-size must be at least 1, got {num_stages}")
    if num_stages > num_layers:
        raise ConfigError(f"{what} exceeds --num-layers {num_layers}: "
                          "every pipeline stage needs at least one Transformer layer")
    if per_stage is not None:
        try:
            counts = [int(x) for x in per_stage.split(",")]
        except ValueError:
            raise ConfigError(f"--num-layers-per-stage {per_stage!r} must be comma-separated integers, "
                              "one per pipeline stage") from None
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
            raise ConfigError(f"--num-layers-per-stage {per_stage} must give {num_stages} positive numbers "
                              f"(one per stage) adding up to --num-layers {num_layers} (got {len(counts)} "
                              f"numbers summing to {sum(counts)})")
    else:
        if num_layers % num_stages:
            raise ConfigError(f"--num-layers {num_layers} is not divisible by {what}; give "
                              "--num-layers-per-stage for an uneven split")
        counts = [num_layers // num_stages] * num_stages
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges


def hidden_spec(sequence_parallel: bool) -> ShardingSpec:
    """``S1,S0,R`` under sequence parallelism (sequence over tp), else ``R,S0,R``."""
    return ShardingSpec.parse("S1,S0,R" if sequence_parallel else "R,S0,R")


def hidden_global_shape(cfg: Config, dp: int) -> tuple[int, int, int]:
    """Global ``[seq, micro_batch × dp, hidden]`` of one microbatch's hidden states.

    With per-stage layouts pass ``cfg.dp(world)`` (the largest stage dp): the global
    microbatch is the same for every stage, each stage shards it over its own dp.
    """
    return (cfg.model.seq_length, cfg.training.micro_batch_size * dp, cfg.model.hidden_size)


def virtual_stages(cfg: Config) -> int:
    """Stages per pipeline rank: 1, or the virtual stages the arguments resolved (zbv: 2)."""
    return virtual_stages_per_rank(cfg)


def stage_placement(cfg: Config, pp: int) -> tuple[int, ...]:
    """The mesh (pp rank) of every stage: stage s on mesh s, or the schedule's virtual placement —
    Megatron-LM's interleaving puts virtual stage ``v·P + p`` on mesh p; zbv the V shape."""
    v = virtual_stages(cfg)
    return tuple(range(pp)) if v == 1 else placement_of(cfg.pipeline.pipeline_schedule, pp, v)


def stage_layouts(cfg: Config, topology: Topology) -> list[StageLayout]:
    """Layout of every stage (the same on every rank: the runtime builds edges from it).

    Per-stage layouts: each stage's mesh has its own shape and its hidden spec its own
    sequence-parallel choice (``S1`` only where that stage's tp > 1). With virtual stages there are
    ``pp × V`` stages in model order, each on the mesh `stage_placement` gives it.
    """
    v = virtual_stages(cfg)
    n = topology.pp * v
    what = None if v == 1 else f"pp {topology.pp} × {v} virtual stages = {n} stages"
    ranges = split_layers(cfg.model.num_layers, n, cfg.pipeline.num_layers_per_stage, what)
    place = stage_placement(cfg, topology.pp)
    out = []
    for i in range(n):
        p = place[i]
        sp = cfg.parallel.sequence_parallel and stage_tp_dp(topology, p)[0] > 1
        out.append(StageLayout(i, ranges[i], stage_mesh(topology, p), hidden_spec(sp)))
    return out


def check_pipeline_config(cfg: Config, world_size: int) -> None:
    """Start-up validation of everything the pipeline needs, with the numbers in the message.

    Runs before any model or communicator is built, so a bad flag fails in milliseconds
    on every rank instead of deadlocking later.
    """
    pp, pl, t = cfg.pp, cfg.pipeline, cfg.training
    if pl.pipeline_schedule not in SCHEDULES:
        raise ConfigError(f"unknown --pipeline-schedule {pl.pipeline_schedule!r}; available: "
                          f"{', '.join(RUNTIME_SCHEDULES)}")
    if pl.pipeline_schedule not in RUNTIME_SCHEDULES:
        raise ConfigError(f"--pipeline-schedule {pl.pipeline_schedule} is not run by the runtime (tools/plot_schedule.py "
                          f"and the simulator draw it); runnable: {', '.join(RUNTIME_SCHEDULES)}")
    if pl.reshard_strategy not in _EXECUTABLE_STRATEGIES:
        raise ConfigError(f"unknown --reshard-strategy {pl.reshard_strategy!r}; available: "
                          f"{', '.join(_EXECUTABLE_STRATEGIES)}")
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
    if REGISTRY[pl.pipeline_schedule].microbatch_multiple_of_pp and m % pp:
        raise ConfigError(f"--pipeline-schedule {pl.pipeline_schedule}: {m} microbatches are not a multiple of "
                          f"--pipeline-model-parallel-size {pp}: interleaving sends microbatches through the chunks "
                          "in groups of pp")
    if pp > 1 and m < pp:
        warnings.warn(f"{m} microbatch(es) for {pp} pipeline stages: the bubble is at least "
                      f"{(pp - 1) / (m + pp - 1):.0%} of the step; raise --global-batch-size to at least "
                      f"{pp * t.micro_batch_size * dp} to fill the pipeline", stacklevel=2)
    if pp > 1 and pl.reshard_strategy == "signal":
        warnings.warn("--reshard-strategy signal moves one byte per task: stage inputs are undefined, "
                      "so the loss is meaningless (it is the communication upper bound for benchmarks)",
                      stacklevel=2)


def build_stage_model(cfg: Config, ctx: ParallelContext, layout: StageLayout, *, seed: int,
                      device: torch.device, num_stages: int | None = None, **model_kwargs):
    """This rank's part of the GPT: its layers, the embedding on the first stage, the head on the last.

    A last stage without the embedding holds its own copy of the tied word embedding
    (``output_layer.weight``, initialised identically); ``GPTModel`` marks it
    ``shared_embedding_duplicate`` so the gradient norm counts the pair once, and the
    trainer all-reduces the two copies' gradients over ``ctx.embedding_group`` (nothing to
    tie with ``--untie-embeddings-and-output-weights``).
    ``model_kwargs`` (dtype, recomputation, shared RNG streams) go to ``GPTModel`` unchanged.
    ``num_stages``: all stages of the graph (default pp; ``pp × V`` with virtual stages).
    """
    from ..models.gpt import GPTModel

    first, last = layout.stage == 0, layout.stage == (num_stages or ctx.pp_size) - 1
    model = GPTModel(cfg.model, ctx, sequence_parallel=cfg.parallel.sequence_parallel and ctx.tp_size > 1,
                     seed=seed, pre_process=first, post_process=last, layer_range=layout.layer_range,
                     device=device, **model_kwargs)
    return model


def chain_graph(num_stages: int) -> PipelineGraph:
    """The GPT's stage graph: a plain chain (no skip edges)."""
    return PipelineGraph(num_stages)


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
