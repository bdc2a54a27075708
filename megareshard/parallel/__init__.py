"""Parallel layout: pure topology (rank <-> coordinates, hosts, placement order) and the
ParallelContext that owns the process groups.

``ParallelContext`` (torch.distributed) is imported on first use, so the pure topology, and the argument
parser built on it, load without torch (``pretrain_gpt.py --help`` answers at once)."""
from .stage_topology import StageTopology, parse_stage_layouts
from .topology import AXES, CommVolume, RankCoords, Topology, TopologyError, hosts_spanned, parse_order

__all__ = ["AXES", "CommVolume", "ParallelContext", "RankCoords", "StageTopology", "Topology", "TopologyError",
           "parse_stage_layouts",
           "hosts_spanned", "parse_order"]


def __getattr__(name: str):
    if name == "ParallelContext":
        from .context import ParallelContext

        return ParallelContext
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
