"""Parallel layout: pure topology (rank <-> coordinates, hosts, placement order) and the
ParallelContext that owns the process groups."""
from .context import ParallelContext
from .stage_topology import StageTopology, parse_stage_layouts
from .topology import AXES, CommVolume, RankCoords, Topology, TopologyError, hosts_spanned, parse_order

__all__ = ["AXES", "CommVolume", "ParallelContext", "RankCoords", "StageTopology", "Topology", "TopologyError",
           "parse_stage_layouts",
           "hosts_spanned", "parse_order"]
