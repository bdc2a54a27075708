"""What each compute action of a schedule consumes and produces across stages (pure), shared by the
lowering and the validator."""
from __future__ import annotations

from .schedule import Action, ActionKind, Edge, PipelineGraph, Schedule

__all__ = ["local_edges"]

_K = ActionKind


def _consumes(a: Action, graph: PipelineGraph, local: frozenset[Edge] = frozenset()) -> list[tuple[Edge, str]]:
    """(edge, direction) pairs whose received tensor compute action `a` needs (`local` edges are handed
    off inside a mesh: nothing is received)."""
    if a.kind == _K.F:
        return [(e, "F") for e in graph.in_edges(a.stage) if e not in local]
    if a.kind in (_K.B, _K.I):
        return [(e, "B") for e in graph.out_edges(a.stage) if e not in local]
    return []


def _produces(a: Action, graph: PipelineGraph, local: frozenset[Edge] = frozenset()) -> list[tuple[Edge, str]]:
    """(edge, direction) pairs whose tensor compute action `a` produces to send (not `local` ones)."""
    if a.kind == _K.F:
        return [(e, "F") for e in graph.out_edges(a.stage) if e not in local]
    if a.kind in (_K.B, _K.I):
        return [(e, "B") for e in graph.in_edges(a.stage) if e not in local]
    return []


def local_edges(schedule: Schedule) -> frozenset[Edge]:
    """Edges between two stages of one mesh: local hand-offs, no communication."""
    return frozenset(e for e in schedule.graph.edges if schedule.is_local(e))
