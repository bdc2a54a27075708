"""The mesh of every pipeline stage (pure: a `Topology` in, `Mesh`es out; no process groups).

The mesh of stage ``i`` is the ranks with pp coordinate ``i`` laid out as a 2-D ``dp × tp`` grid
(axis 0 = dp, axis 1 = tp), each rank's host taken from the topology.
"""
from __future__ import annotations

from ..parallel import Topology
from ..resharding import Mesh

__all__ = ["stage_tp_dp", "stage_mesh"]


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
