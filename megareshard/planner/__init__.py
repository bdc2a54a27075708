"""Layout planner: tp, pp, dp, microbatch, schedule, resharding strategy, recomputation and ZeRO
chosen from the model and the cluster (pure planning: no processes, no devices).

    from megareshard.planner import ClusterSpec, ModelShape, plan_layouts
    ranked = plan_layouts(ModelShape(...), ClusterSpec(...), global_batch=512)
    ranked[0].flags()          # ready to paste after pretrain_gpt.py

Cost terms (`costs.py`) are the textbook ones — per-layer GEMM FLOPs, ring collectives for
tp and dp, Korthikanti et al.'s activation bytes ("Reducing Activation Recomputation in
Large Transformer Models") —; cross-stage transfers come from the resharding planner and
its network model, and the pipeline from the schedule simulator (`search.py`). What a caller's cluster adds
to that model comes in as extra cost terms (`terms.py`: ``plan_layouts(..., terms=[...])``, none by default).
"""
from .costs import ClusterSpec, ModelShape, StageCosts, stage_costs
from .search import Candidate, PlanError, plan_layouts
from .terms import CostTerm, TermInput, TermStep

__all__ = ["ClusterSpec", "ModelShape", "StageCosts", "stage_costs", "Candidate", "PlanError", "plan_layouts",
           "CostTerm", "TermInput", "TermStep"]
