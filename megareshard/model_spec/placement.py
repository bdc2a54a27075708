"""Where every pipeline stage lives: its layers, its mesh, the layout of its boundary tensors.

docs/design.md §1: a stage is (its layers, its mesh, the layout of every tensor it consumes
and produces). The mesh of stage ``i`` is the ranks with pp coordinate ``i`` laid out as a
2-D ``dp × tp`` grid (axis 0 = dp, axis 1 = tp), each rank's host taken from the topology.
A Transformer's hidden states ``[s, b, h]`` are

* ``R,S0,R``  — batch over dp, replicated over tp (plain tensor parallelism), or
* ``S1,S0,R`` — sequence over tp as well (sequence parallelism),

so the resharding planner sees exactly which slice every rank holds and needs. The *global*
hidden tensor of one microbatch is ``[seq, micro_batch × dp, hidden]``: every stage processes
the same global microbatch, each sharded over its own dp.

Pure (no process groups, no model, no pipeline runtime): the model specs build their stage
layouts from these pieces, the pipeline, the planner and the tools read them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..config_fields import ConfigError
from ..parallel import Topology
from ..resharding import Mesh, ShardingSpec

__all__ = ["StageLayout", "split_layers", "hidden_spec", "stage_layouts", "stage_tp_dp", "stage_mesh"]


@dataclass(frozen=True)
class StageLayout:
    """Where one stage lives and how its boundary hidden states are laid out."""

    stage: int
    """the stage's index in the stage graph"""
    layer_range: tuple[int, int]
    """global layers [start, stop) of the model that the stage holds"""
    mesh: Mesh
    """dp × tp ranks of this stage"""
    hidden_spec: ShardingSpec
    """layout of the [s, b, h] hidden states it receives and sends"""

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


def stage_tp_dp(topology: Topology, stage: int) -> tuple[int, int]:
    """(tp, dp) of one stage: the uniform degrees, or the stage's own entry of a `StageTopology`."""
    if getattr(topology, "per_stage", False):
        return topology.tp_of(stage), topology.dp_of(stage)
    return topology.tp, topology.dp


def stage_mesh(topology: Topology, stage: int) -> Mesh:
    """The ``dp × tp`` mesh of ranks with pp coordinate ``stage``; hosts from the topology."""
    tp, dp = stage_tp_dp(topology, stage)
    ranks = [[topology.rank_of(tp=t, dp=d, pp=stage) for t in range(tp)]
             for d in range(dp)]
    hosts = {r: r // topology.nproc_per_node for row in ranks for r in row}
    return Mesh(ranks, hosts)


def stage_layouts(cfg: Any, topology: Topology, placement: Sequence[int] | None = None) -> list[StageLayout]:
    """Layout of every stage of a Transformer whose hidden states are ``[s, b, h]`` (the same on every
    rank: the pipeline builds the edges from it). ``cfg`` is the run's configuration
    (``--num-layers``, ``--num-layers-per-stage``, ``--sequence-parallel``).

    Per-stage layouts: each stage's mesh has its own shape and its hidden spec its own
    sequence-parallel choice (``S1`` only where that stage's tp > 1). ``placement`` gives the mesh
    (pp rank) of every stage (default: stage s on mesh s); with virtual stages it names ``pp × V``
    stages in model order, each laid out on its mesh.
    """
    place = tuple(placement) if placement is not None else tuple(range(topology.pp))
    n, v = len(place), len(place) // topology.pp
    what = None if v == 1 else f"pp {topology.pp} × {v} virtual stages = {n} stages"
    ranges = split_layers(cfg.model.num_layers, n, cfg.pipeline.num_layers_per_stage, what)
    out = []
    for i, p in enumerate(place):
        sp = cfg.parallel.sequence_parallel and stage_tp_dp(topology, p)[0] > 1
        out.append(StageLayout(i, ranges[i], stage_mesh(topology, p), hidden_spec(sp)))
    return out
