"""A candidate layout and its predicted cost: what the search (`search.py`) ranks, with the trainer's flags for it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..pipeline.schedules import get_schedule

__all__ = ["Candidate"]


@dataclass
class Candidate:
    """One layout with its predicted cost."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    num_microbatches: int
    schedule: str
    delay_wgrad: bool
    strategy: str
    sequence_parallel: bool
    recompute: bool
    zero: int
    order: str
    layers_per_stage: tuple[int, ...] | None = None
    """Layers of every pipeline stage when not an even split (`--num-layers-per-stage`)."""
    stage_layouts: str | None = None
    """Per-stage meshes (`--stage-layouts`), None for a uniform layout."""
    virtual_stages: int = 1
    """Stages per mesh (interleaved kinds: V; zbv: 2)."""
    runtime: bool = True
    """The pipeline runtime executes this schedule today (the others are predictions only)."""
    step_s: float = math.inf
    estimate_s: float = math.inf
    bubble: float = 0.0
    memory_gib: list[float] = field(default_factory=list)
    live_microbatches: list[int] = field(default_factory=list)
    edge_s: float = 0.0
    stage_f_s: list[float] = field(default_factory=list)
    """Predicted forward seconds of one microbatch per stage (the paced budgets of a validation run)."""
    stage_b_s: list[float] = field(default_factory=list)
    """Predicted backward seconds of one microbatch per stage."""
    stage_w_s: list[float] = field(default_factory=list)
    """The weight-gradient part (W) of `stage_b_s` per stage; I is the rest."""
    tp_bytes: int = 0
    pp_nic_bytes: int = 0
    dp_nic_bytes: int = 0
    bottleneck: str = ""
    breakdown: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    terms: dict[str, float] = field(default_factory=dict)
    """The quantity of every extra cost term the caller gave (`terms.py`), by the term's name (simulated
    candidates only; none on a real cluster)."""

    @property
    def name(self) -> str:
        mesh = f"[{self.stage_layouts}]" if self.stage_layouts else f"tp{self.tp} pp{self.pp} dp{self.dp}"
        split = f" L{','.join(map(str, self.layers_per_stage))}" if self.layers_per_stage else ""
        v = f" v{self.virtual_stages}" if self.virtual_stages > 1 and \
            get_schedule(self.schedule).stages_per_mesh is None else ""
        return (f"{mesh}{split} mb{self.micro_batch} {self.schedule}{v}"
                f"{'+dw' if self.delay_wgrad else ''} {self.strategy}"
                f"{' sp' if self.sequence_parallel else ''}{' recompute' if self.recompute else ''} zero{self.zero}")

    def flags(self, num_layers: int | None = None) -> str:
        """The trainer's flags for this layout (Megatron's names where Megatron has them)."""
        if self.stage_layouts:
            f = [f"--stage-layouts {self.stage_layouts}"]
        else:
            f = [f"--tensor-model-parallel-size {self.tp}", f"--rank-order {self.order}"]
        f += [f"--pipeline-model-parallel-size {self.pp}", f"--micro-batch-size {self.micro_batch}",
              f"--pipeline-schedule {self.schedule}", f"--reshard-strategy {self.strategy}"]
        if self.layers_per_stage:
            f.append(f"--num-layers-per-stage {','.join(map(str, self.layers_per_stage))}")
        if self.virtual_stages > 1 and get_schedule(self.schedule).stages_per_mesh is None and num_layers:
            f.append(f"--num-layers-per-virtual-pipeline-stage {num_layers // (self.pp * self.virtual_stages)}")
        if self.delay_wgrad and not get_schedule(self.schedule).zero_bubble:
            f.append("--delay-wgrad-compute")
        if self.sequence_parallel:
            f.append("--sequence-parallel")
        if self.recompute:
            f.append("--recompute-granularity full")
        if self.zero:
            f.append(f"--zero-stage {self.zero}")
        return " ".join(f)

    def to_dict(self) -> dict[str, Any]:
        keys = ("tp", "pp", "dp", "micro_batch", "num_microbatches", "schedule", "delay_wgrad", "strategy",
                "sequence_parallel", "recompute", "zero", "order", "layers_per_stage", "stage_layouts",
                "virtual_stages", "runtime", "step_s", "estimate_s", "bubble", "memory_gib", "live_microbatches",
                "edge_s", "stage_f_s", "stage_b_s", "stage_w_s", "tp_bytes", "pp_nic_bytes", "dp_nic_bytes",
                "bottleneck", "breakdown", "tokens_per_s", "terms")
        return {k: getattr(self, k) for k in keys} | {"name": self.name, "flags": self.flags()}
