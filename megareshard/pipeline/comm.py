"""Cross-stage communication: one forward and one backward `Resharder` per pipeline edge.

Why it looks like this:

* **Built once, collectively, in one global order.** Every rank plans every edge's two
  resharders and agrees on rank 0's plans in one collective over the default group
  (`agree_on_orders`), then builds them all — even ranks in neither mesh — in sorted edge
  order, forward before backward (construction creates communicators: collective too).
  Nothing is created lazily (lazy communicators in rank-dependent order are a classic
  pipeline deadlock).
* **One set of communicators for the job.** Every resharder shares one `CommStreams`, so
  tasks with the same (participants, forwarders) — the same dp slice of an edge every
  microbatch, or both directions of an edge between two single ranks — share one
  communicator, whatever edge they belong to; between mesh pairs the posting plan cannot
  group under NCCL's ordering (`posting.split_pairs`) each direction keeps its own. No tags:
  messages pair by issue order (NCCL's rule). That a communicator's members see its
  operations in one order is the lowering's and the posting plan's guarantee; the NCCL
  checking mode proves it on gloo.
* **Declared shapes, checked at every send.** The shape and dtype of every edge's
  tensor are declared by the model's spec from the configuration (micro batch, sequence,
  widths), never taken from the first batch seen (Megatron #5100). A send of anything
  else raises, naming the edge, the direction, the microbatch, what was expected and what
  was given.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..resharding import plan_resharding
from ..resharding.executor import CommStreams, ReshardHandle, Resharder, agree_on_orders
from ..model_spec.graph import Edge, EdgeTensor, PipelineGraph  # EdgeTensor: re-exported

__all__ = ["EdgeShapeError", "EdgeTensor", "EdgeComm", "plan_edges", "communicator_keys", "shared_mesh_pairs",
           "build_edge_comms"]


class EdgeShapeError(ValueError):
    """A tensor sent along a pipeline edge does not match the edge's declared shape/dtype."""


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
                f"{tensor.dtype}; the model's spec declares every edge's shape from the configuration "
                "(ModelSpec.edge_shapes)")

    def send_forward(self, tensor: torch.Tensor, mb: int, post: bool = True) -> ReshardHandle:
        self._check(tensor, self.fwd, "F", mb)
        return self.fwd.start(tensor.detach(), post=post)

    def recv_forward(self, post: bool = True) -> ReshardHandle:
        return self.fwd.start(None, post=post)

    def send_backward(self, grad: torch.Tensor, mb: int, post: bool = True) -> ReshardHandle:
        self._check(grad, self.bwd, "B", mb)
        return self.bwd.start(grad.detach(), post=post)

    def recv_backward(self, post: bool = True) -> ReshardHandle:
        return self.bwd.start(None, post=post)


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


def communicator_keys(plans: Sequence[tuple[Edge, str, Any]]) -> list[tuple]:
    """The distinct communicators the plans' tasks run on, in creation order: ``(participants, forwarders)``
    (`resharding.messages.comm_key`, with gloo's message layout) — what `Resharder` creates through one shared
    `CommStreams` (pure)."""
    from math import prod

    from ..resharding.messages import _TaskProgram, build_messages, comm_key, rotate_receivers

    keys: dict[tuple, None] = {}
    for _, _, plan in plans:
        host_of = {r: plan.dst_mesh.host_of(r) for r in plan.dst_mesh.flat_ranks}
        host_of.update({r: plan.src_mesh.host_of(r) for r in plan.src_mesh.flat_ranks})
        turns: dict[int, int] = {}
        for pos, t in enumerate(plan.tasks):
            remote = rotate_receivers(sorted(r for r in t.receivers if r not in set(t.senders)), host_of, turns)
            if not remote:
                continue
            shape = tuple(s.stop - s.start for s in t.slice)
            msgs = build_messages(plan.strategy, prod(shape), t.sender, remote, host_of, int(t.chunks))
            prog = _TaskProgram(pos, t.index, tuple(t.slice), shape, prod(shape), t.sender, (), msgs,
                                (t.sender, *remote), chunks=int(t.chunks))
            keys.setdefault(comm_key(prog), None)
    return list(keys)


def shared_mesh_pairs(comms: dict[Edge, "EdgeComm"], placement: Sequence[int]) -> frozenset[frozenset[int]]:
    """The mesh pairs whose two directions share a communicator (some task of each direction has the same
    key: two one-rank ends), from the built resharders' agreed plans — where the pipeline's posting plan must
    order receives and sends on one communicator (`posting.py`)."""
    dirs: dict[tuple, set[tuple[int, int]]] = {}
    for e, c in comms.items():
        for res, (a, b) in ((c.fwd, (e.src, e.dst)), (c.bwd, (e.dst, e.src))):
            for p in res.programs:
                key = res.comm_key(p)
                if key is not None:
                    dirs.setdefault(key, set()).add((placement[a], placement[b]))
    out = set()
    for pairs in dirs.values():
        for a, b in pairs:
            if (b, a) in pairs:
                out.add(frozenset((a, b)))
    return frozenset(out)


def build_edge_comms(graph: PipelineGraph, decls: Sequence[EdgeTensor], *, strategy: str, scheduler: str,
                     chunks: int | None, time_budget_s: float = 0.5, group: Any = None,
                     streams: CommStreams | None = None, skip: frozenset[Edge] = frozenset(),
                     split: frozenset[frozenset[int]] = frozenset(),
                     placement: Sequence[int] | None = None) -> dict[Edge, EdgeComm]:
    """Plan and build every edge's resharders — collective over the default group.

    Every rank must call it with the same arguments. Edges are processed in the graph's
    sorted order, forward before backward; all share `streams` (default: a new `CommStreams`).
    `chunks` None lets the network model choose each broadcast task's chunk count. Edges in
    ``skip`` (local hand-offs) get no resharders. Between the mesh pairs in `split` (``placement``: each
    stage's mesh, default stage s on mesh s) each direction keeps communicators of its own
    (`posting.split_pairs`: where grouped posting cannot run under NCCL's ordering).
    """
    streams = streams if streams is not None else CommStreams()
    mesh = list(placement) if placement is not None else list(range(graph.num_stages))
    by_edge = {d.edge: d for d in decls}
    built: dict[Edge, list[Resharder]] = {}
    plans = plan_edges(graph, decls, strategy=strategy, scheduler=scheduler, chunks=chunks,
                       time_budget_s=time_budget_s, skip=skip)
    orders = agree_on_orders([plan for _, _, plan in plans])  # one collective for every edge
    for (e, direction, plan), order in zip(plans, orders):
        sender = mesh[e.src] if direction == "F" else mesh[e.dst]
        apart = frozenset((mesh[e.src], mesh[e.dst])) in split
        built.setdefault(e, []).append(Resharder(plan, by_edge[e].dtype, group=group, streams=streams,
                                                 name=f"edge{e}{direction}", agreed_order=order,
                                                 key_suffix=(("from mesh", sender),) if apart else ()))
    return {e: EdgeComm(by_edge[e], f, b) for e, (f, b) in built.items()}
