"""The mesh of every pipeline stage: lives in `megareshard.model_spec.placement` (neutral ground the model
specs share); re-exported here for the planner and the tools."""
from __future__ import annotations

from ..model_spec.placement import stage_mesh, stage_tp_dp

__all__ = ["stage_tp_dp", "stage_mesh"]
