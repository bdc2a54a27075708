"""Cross-stage communication: one forward and one backward `Resharder` per pipeline edge.

Why it looks like this:

* **Built once, collectively, in one global order.** `Resharder` construction is
  collective over the default group (it agrees on rank 0's plan), so every rank builds
  every edge's two resharders — even ranks in neither mesh — in sorted edge order,
  forward before backward. Nothing is created lazily (lazy communicators in
  rank-dependent order are a classic pipeline deadlock).
* **One set of communicators for the job.** Every resharder shares one `CommStreams`, so
  tasks with the same (sender, receivers) — the same dp slice of an edge every microbatch,
  say — share one communicator and its one driving thread, whatever edge they belong to.
  No tags: messages pair by issue order (NCCL's rule). That a communicator's members see
  its runs in one order is the lowering's guarantee (a receiver posts receives in its
  sender's order); the NCCL checking mode proves it on gloo.
* **Declared shapes, checked at every send.** The shape and dtype of every edge's
  tensor come from the configuration (micro batch, sequence, hidden), never from the
  first batch seen (Megatron #5100). A send of anything else raises, naming the edge,
  the direction, the microbatch, what was expected and what was given.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..resharding import Mesh, ShardingSpec, plan_resharding
from ..resharding.executor import CommStreams, ReshardHandle, Resharder
from .schedule import Edge, PipelineGraph

__all__ = ["EdgeShapeError", "EdgeTensor", "EdgeComm", "plan_edges", "communicator_keys", "build_edge_comms"]


class EdgeShapeError(ValueError):
    """A tensor sent along a pipeline edge does not match the edge's declared shape/dtype."""


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


class EdgeComm:
    """The forward (src stage → dst stage) and backward (dst → src) resharders of one edge."""

    def __init__(self, decl: EdgeTensor, fwd: Resharder, bwd: Resharder) -> None:
        self.decl, self.fwd, self.bwd = decl, fwd, bwd

    @property
    def edge(self) -> Edge:
        return self.decl.edge

    def _check(self, tensor: torch.Tensor, res: Resharder, direction: str, mb: int) -> None:
        want_shape, want_dtype = res.src_shape, self.decl.dtype
        what = "activation" if direction == "F" else "gradient"
        if want_shape is None:
            raise EdgeShapeError(f"edge {self.edge} ({what}, mb {mb}): rank {res.rank} is not a sender of this "
                                 "edge but tried to send on it")
        if not isinstance(tensor, torch.Tensor):
            raise EdgeShapeError(f"edge {self.edge} ({what}, mb {mb}): expected a tensor of shape "
                                 f"{tuple(want_shape)} {want_dtype}, got {type(tensor).__name__}")
        if tuple(tensor.shape) != tuple(want_shape) or tensor.dtype != want_dtype:
            spec = self.decl.src_spec if direction == "F" else self.decl.dst_spec
            mesh = self.decl.src_mesh if direction == "F" else self.decl.dst_mesh
            raise EdgeShapeError(
                f"edge {self.edge} ({what}, mb {mb}): expected local shape {tuple(want_shape)} {want_dtype} "
                f"(global {self.decl.shape}, spec {spec} on mesh {mesh}), got {tuple(tensor.shape)} "
                f"{tensor.dtype}; the edge's shape is declared from --micro-batch-size, --seq-length and "
                "--hidden-size")

    def send_forward(self, tensor: torch.Tensor, mb: int) -> ReshardHandle:
        self._check(tensor, self.fwd, "F", mb)
        return self.fwd.start(tensor.detach())

    def recv_forward(self) -> ReshardHandle:
        return self.fwd.start(None)

    def send_backward(self, grad: torch.Tensor, mb: int) -> ReshardHandle:
        self._check(grad, self.bwd, "B", mb)
        return self.bwd.start(grad.detach())

    def recv_backward(self) -> ReshardHandle:
        return self.bwd.start(None)


def plan_edges(graph: PipelineGraph, decls: Sequence[EdgeTensor], *, strategy: str, scheduler: str,
               chunks: int | None, time_budget_s: float = 0.5,
               skip: frozenset[Edge] = frozenset()) -> list[tuple[Edge, str, Any]]:
    """Every edge's forward and backward resharding plan, in the one global order (pure planning).

    Returns ``(edge, 'F' | 'B', plan)`` in graph edge order, forward before backward. Edges in
    ``skip`` (local hand-offs between two stages of one mesh: nothing crosses ranks) get none.
    """
    by_edge = {d.edge: d for d in decls}
    missing = [str(e) for e in graph.edges if e not in by_edge and e not in skip]
    if missing:
        raise ValueError(f"no tensor declared for edge(s) {', '.join(missing)}")
    out = []
    for e in graph.edges:
        if e in skip:
            continue
        d = by_edge[e]
        itemsize = torch.empty(0, dtype=d.dtype).element_size()
        for direction, src_mesh, src_spec, dst_mesh, dst_spec in (
                ("F", d.src_mesh, d.src_spec, d.dst_mesh, d.dst_spec),
                ("B", d.dst_mesh, d.dst_spec, d.src_mesh, d.src_spec)):
            plan = plan_resharding(d.shape, src_mesh, src_spec, dst_mesh, dst_spec, strategy=strategy,
                                   scheduler=scheduler, itemsize=itemsize, time_budget_s=time_budget_s,
                                   broadcast_chunks=chunks)
            out.append((e, direction, plan))
    return out


def communicator_keys(plans: Sequence[tuple[Edge, str, Any]]) -> list[tuple[int, tuple[int, ...]]]:
    """The distinct (sender, receivers over the network) communicators the plans' tasks run on, in
    creation order — what `Resharder` creates through one shared `CommStreams` (pure)."""
    keys: dict[tuple[int, tuple[int, ...]], None] = {}
    for _, _, plan in plans:
        for t in plan.tasks:
            remote = tuple(sorted(r for r in t.receivers if r not in set(t.senders)))
            if remote:
                keys.setdefault((t.sender, remote), None)
    return list(keys)


def build_edge_comms(graph: PipelineGraph, decls: Sequence[EdgeTensor], *, strategy: str, scheduler: str,
                     chunks: int | None, time_budget_s: float = 0.5, group: Any = None,
                     streams: CommStreams | None = None, skip: frozenset[Edge] = frozenset()) -> dict[Edge, EdgeComm]:
    """Plan and build every edge's resharders — collective over the default group.

    Every rank must call it with the same arguments. Edges are processed in the graph's
    sorted order, forward before backward; all share `streams` (default: a new `CommStreams`).
    `chunks` None lets the network model choose each broadcast task's chunk count. Edges in
    ``skip`` (local hand-offs) get no resharders.
    """
    streams = streams if streams is not None else CommStreams()
    by_edge = {d.edge: d for d in decls}
    built: dict[Edge, list[Resharder]] = {}
    for e, direction, plan in plan_edges(graph, decls, strategy=strategy, scheduler=scheduler, chunks=chunks,
                                         time_budget_s=time_budget_s, skip=skip):
        built.setdefault(e, []).append(Resharder(plan, by_edge[e].dtype, group=group,
                                                 streams=streams, name=f"edge{e}{direction}"))
    return {e: EdgeComm(by_edge[e], f, b) for e, (f, b) in built.items()}
