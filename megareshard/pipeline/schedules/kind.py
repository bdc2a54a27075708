"""`ScheduleKind`: everything the rest of megareshard needs to know about one pipeline schedule.

The arguments, the generator front (`generators.generate`), the runtime and the planner read these
facts from the kind; none of them matches schedule names. A fact the planner needs and the kind does
not give (`live_bound`) makes the planner refuse the kind, naming it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..schedule import PipelineGraph, Schedule

__all__ = ["ScheduleKind", "round_robin"]


def round_robin(P: int, V: int) -> tuple[int, ...]:
    """Stage s on mesh s mod P: Megatron-LM's interleaving (virtual stage v·P + p on mesh p); with V = 1,
    stage s on mesh s."""
    return tuple(s % P for s in range(P * V))


@dataclass(frozen=True)
class ScheduleKind:
    """One pipeline schedule and its facts."""

    name: str
    """Its name (`--pipeline-schedule`)."""
    build: Callable[[int, int, int, PipelineGraph], Schedule]
    """(meshes P, microbatches m, stages per mesh V, graph of P·V stages) -> the compute-only schedule
    (F/B, or F/I/W for a zero-bubble kind), stages placed by `placement`."""
    stages_per_mesh: int | None
    """1 (one stage per mesh), a fixed number (zbv: 2), or None: V is the user's (Megatron-LM's virtual
    pipeline flags), at least 2."""
    live_bound: Callable[[int, int, int, bool], Sequence[int]] | None
    """(P, m, V, delayed W) -> per mesh, an upper bound of its live (stage, microbatch) activations: what the
    planner prunes memory with before it simulates (tests check it against the simulator's peak). None: the
    planner refuses the kind."""
    placement: Callable[[int, int], tuple[int, ...]] = round_robin
    """(P, V) -> the mesh of every stage."""
    zero_bubble: bool = False
    """An I/W schedule by definition: delayed weight gradients are implied, `--delay-wgrad-compute` adds nothing."""
    microbatch_multiple_of_pp: bool = False
    """The microbatch count must be a multiple of P (Megatron-LM's rule for interleaving: microbatches go
    through the chunks in groups of P)."""
    interleaved_twin: str | None = None
    """The kind this one runs as when Megatron-LM's virtual-stage flags ask for V > 1 (1f1b ->
    interleaved-1f1b); None: virtual stages are refused for a one-stage-per-mesh kind."""
    warmup: Callable[[int, int, int], int] | None = None
    """(P, m, stage i) -> forwards stage i runs before its first backward (``k_i``, its peak live
    activations), for the one-stage-per-mesh warm-up kinds; None elsewhere."""
    search_delay_wgrad: bool = True
    """The planner also scores the kind with delayed weight gradients (zero-bubble kinds: always delayed)."""

    def stages(self, virtual_stages: int | None = None) -> int:
        """V to build with: the kind's own, or the `virtual_stages` asked for (default 2) where V is the user's.
        Raises ValueError for a count the kind cannot hold."""
        if self.stages_per_mesh is not None and virtual_stages not in (None, self.stages_per_mesh):
            raise ValueError(f"schedule {self.name!r} puts {self.stages_per_mesh} stage(s) on each mesh, "
                             f"not {virtual_stages}")
        V = self.stages_per_mesh or (virtual_stages if virtual_stages is not None else 2)
        if V < 1:
            raise ValueError(f"need at least one stage per mesh, got {V}")
        return V

    def virtual_options(self, pp: int, num_layers: int, microbatches: int, max_v: int = 4) -> list[int]:
        """Every V the kind can run with on `pp` meshes: [1] for one stage per mesh (whatever the layers: a split
        that pp does not divide is uneven), its own V where pp·V divides the layers, every V in 2..max_v dividing
        layers / pp where V is the user's; none where the microbatch rule fails or virtual stages meet pp < 2."""
        if pp < 2 and self.stages_per_mesh != 1:
            return []
        if self.microbatch_multiple_of_pp and microbatches % pp:
            return []
        if self.stages_per_mesh == 1:
            return [1]
        if self.stages_per_mesh is not None:
            v = self.stages_per_mesh
            return [v] if num_layers % (pp * v) == 0 else []
        return [v for v in range(2, max_v + 1) if num_layers % (pp * v) == 0]

    def live(self, P: int, m: int, V: int, delay_wgrad: bool) -> list[int]:
        """`live_bound` per mesh; ValueError naming the kind when it gives none."""
        if self.live_bound is None:
            raise ValueError(f"schedule {self.name!r} gives no live-activation bound (ScheduleKind.live_bound): "
                             "the planner cannot size its memory; give one, or leave it out of the schedules planned")
        return list(self.live_bound(P, m, V, delay_wgrad))
