"""`PipelinePlan`: what the pipeline runtime is built from — resolved numbers, names and the registered objects
they name, no flags (``run_plan.resolve`` makes it from a validated configuration; the runtime never sees one).
Pure: no torch, no processes."""
from __future__ import annotations

from dataclasses import dataclass

from ..resharding.schedulers import ReshardScheduler
from ..resharding.strategies import Strategy
from .schedules import ScheduleKind

__all__ = ["PipelinePlan"]


@dataclass(frozen=True)
class PipelinePlan:
    """What the pipeline runtime is built from (resolved numbers and names, no flags)."""

    schedule: str
    """The registered schedule (`pipeline.schedules`), after the interleaved-twin rule."""
    delay_wgrad: bool
    """Weight gradients split from the backward (I then W)."""
    strategy: str
    """The registered resharding strategy of every stage boundary (`resharding.strategies`)."""
    scheduler: str
    """How a boundary's resharding tasks are assigned to sender hosts and ordered."""
    chunks: int | None
    """Chunks per pipelined broadcast task (None: chosen per task by the network model)."""
    num_microbatches: int
    """Microbatches per iteration."""
    edge_batch: int
    """Samples of one global microbatch, what every stage boundary carries (micro batch × dp; × the largest dp
    with per-stage layouts): each end shards it over its own dp."""
    placement: tuple[int, ...]
    """The mesh (pp rank) of every stage, in model order."""
    schedule_file: str | None
    """A schedule file to run instead of the generated schedule (checked against the model's graph when the
    runtime is built)."""
    overlap_grad_reduce: bool
    """Each stage's data-parallel reduction started by an R action after its last backward."""
    recv_posting: str = "auto"
    """When receives are posted (`pipeline.posting`): auto, early, grouped or mixed (auto: by the backend)."""
    kind: ScheduleKind | None = None
    """The schedule itself (``schedule``'s registered kind), resolved once."""
    strategy_impl: Strategy | None = None
    """The resharding strategy itself (``strategy``'s registered object)."""
    scheduler_impl: ReshardScheduler | None = None
    """The reshard scheduler itself (``scheduler``'s registered object)."""
    layers_per_stage: tuple[int, ...] = ()
    """Transformer layers of every stage in model order (--num-layers-per-stage, or the even split)."""

    @property
    def num_meshes(self) -> int:
        return max(self.placement) + 1

    @property
    def virtual_stages(self) -> int:
        return len(self.placement) // self.num_meshes
