"""The stage graph: stages, and the named tensors (edges) that cross between them.

Neutral ground shared by the model specs (which build the graph of their model) and the
pipeline engine (which schedules, lowers and runs it): no model, no runtime, no process
group. ``megareshard.pipeline`` re-exports every name here, so ``from megareshard.pipeline
import Edge, PipelineGraph`` keeps working.

* `Edge`: one tensor crossing stages, chain (``i -> i+1``, empty name) or skip (named).
* `PipelineGraph`: the DAG of stages, chain edges implied, skip edges listed.
* `EdgeTensor`: what a model spec declares for an edge — global shape, dtype, and the mesh and
  sharding spec at both ends — from which the pipeline builds the edge's resharders.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # annotations only: the schedule IR, which uses this module, imports no torch
    import torch

    from ..resharding import Mesh, ShardingSpec

__all__ = ["ScheduleError", "Edge", "PipelineGraph", "EdgeTensor"]


class ScheduleError(ValueError):
    """A schedule is malformed, inconsistent with its graph, or deadlocks.

    Errors about one action also carry where it is: ``mesh`` (the program), ``index`` (its
    position in that program, from 0), ``action`` (its text, ``@stage`` included) and ``why``
    (the reason alone), so a schedule file's loader can name the offending cell.
    """

    def __init__(self, message: str, *, mesh: int | None = None, index: int | None = None,
                 action: str | None = None, why: str | None = None) -> None:
        super().__init__(message)
        self.mesh, self.index, self.action, self.why = mesh, index, action, why

    @property
    def located(self) -> bool:
        return self.mesh is not None and self.index is not None


@dataclass(frozen=True, order=True)
class Edge:
    """A tensor that crosses stages: produced by `src`'s F, consumed by `dst`'s F.

    Its gradient flows back: produced by `dst`'s B/I, consumed by `src`'s B/I.
    Chain edges (i -> i+1) have the empty name; skip edges carry a name so that
    several tensors between the same pair of stages stay distinguishable.
    """

    src: int
    dst: int
    name: str = ""

    def __post_init__(self) -> None:
        if self.src < 0 or self.dst <= self.src:
            raise ScheduleError(
                f"edge {self.src}->{self.dst}: need 0 <= src < dst (stages are in "
                f"topological order; a pipeline edge never points backwards)")
        if self.name and not re.fullmatch(r"\w+", self.name):
            raise ScheduleError(f"edge {self.src}->{self.dst}: name {self.name!r} must be "
                                f"a word ([A-Za-z0-9_]+)")

    @property
    def is_chain(self) -> bool:
        return self.name == "" and self.dst == self.src + 1

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}" + (f":{self.name}" if self.name else "")


def _as_edge(e: "Edge | Sequence") -> Edge:
    if isinstance(e, Edge):
        return e
    t = tuple(e)
    if len(t) == 2:
        return Edge(int(t[0]), int(t[1]), f"skip{t[0]}_{t[1]}")
    if len(t) == 3:
        return Edge(int(t[0]), int(t[1]), str(t[2]))
    raise ScheduleError(f"skip edge {e!r}: expected (src, dst) or (src, dst, name)")


@dataclass(frozen=True)
class PipelineGraph:
    """The DAG of stages: chain edges i->i+1 plus optional skip edges.

    `skip_edges` accepts `Edge`s or (src, dst[, name]) tuples; an unnamed tuple gets
    the name ``skip{src}_{dst}``. Edges are kept sorted so that every consumer of the
    graph (lowering, runtime) sees them in one deterministic order.
    """

    num_stages: int
    skip_edges: tuple[Edge, ...] = ()

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ScheduleError(f"num_stages={self.num_stages}: need at least 1 stage")
        skips = tuple(sorted(_as_edge(e) for e in self.skip_edges))
        for e in skips:
            if e.dst >= self.num_stages:
                raise ScheduleError(f"skip edge {e}: stage {e.dst} does not exist "
                                    f"(num_stages={self.num_stages})")
            if e.name == "":
                raise ScheduleError(f"skip edge {e}: skip edges need a non-empty name")
        if len(set(skips)) != len(skips):
            raise ScheduleError(f"duplicate skip edges in {[str(e) for e in skips]}")
        object.__setattr__(self, "skip_edges", skips)
        # derived once: lowering, simulation and the runtime ask for these per action
        chain = tuple(Edge(i, i + 1) for i in range(self.num_stages - 1))
        edges = tuple(sorted(chain + skips))
        object.__setattr__(self, "_edges", edges)
        object.__setattr__(self, "_in", {s: tuple(e for e in edges if e.dst == s) for s in range(self.num_stages)})
        object.__setattr__(self, "_out", {s: tuple(e for e in edges if e.src == s) for s in range(self.num_stages)})

    @property
    def edges(self) -> tuple[Edge, ...]:
        return self._edges  # type: ignore[attr-defined]

    def in_edges(self, stage: int) -> tuple[Edge, ...]:
        """Edges whose activation stage `stage`'s F needs."""
        return self._in.get(stage, ())  # type: ignore[attr-defined]

    def out_edges(self, stage: int) -> tuple[Edge, ...]:
        """Edges whose gradient stage `stage`'s B/I needs (none on the last stage)."""
        return self._out.get(stage, ())  # type: ignore[attr-defined]

    def find_edge(self, src: int, dst: int, name: str = "") -> Edge:
        e = Edge(src, dst, name)
        if e not in self.edges:
            raise ScheduleError(f"edge {e} is not in the graph (edges: "
                                f"{', '.join(map(str, self.edges)) or 'none'})")
        return e


@dataclass(frozen=True)
class EdgeTensor:
    """The declared tensor of one edge: global shape, dtype, and both ends' layouts."""

    edge: Edge
    shape: tuple[int, ...]
    dtype: torch.dtype
    src_mesh: Mesh
    src_spec: ShardingSpec
    dst_mesh: Mesh
    dst_spec: ShardingSpec
