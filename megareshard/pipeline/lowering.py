"""Lowering: insert the communication of every edge into a compute-only schedule.

Receives are derived from the *graph* (the edges a compute consumes), never from
peeking at a neighbour's action list, so skip edges between non-adjacent stages are
lowered exactly like chain edges.

Rules (for every edge e and microbatch mb; "F-direction" = e's activation from e.src to
e.dst, "B-direction" = its gradient from e.dst back to e.src):

* **Send as soon as the tensor exists.** SEND_F(e, mb) immediately after F(mb) on
  e.src; SEND_B(e, mb) immediately after B(mb) or I(mb) on e.dst. Several edges leaving
  one compute are sent in graph edge order.
* **Wait right before the consumer.** WAIT_F(e, mb) immediately before F(mb) on e.dst,
  for every incoming edge; WAIT_B(e, mb) immediately before B(mb)/I(mb) on e.src, for
  every outgoing edge. (The last stage's B/I needs no wait: its gradient is the loss.)
* **Local hand-offs.** An edge between two stages of one mesh (virtual stages) carries
  nothing: the consumer reads the producer's output (and its gradient) in place; program
  order guarantees the producer ran first (`validate` checks it).
* **Post receives early, in the sender's order.** Per channel — a (sending mesh,
  receiving mesh) pair, whatever edges and directions it carries — the receiver posts
  RECV in exactly the order the sender issues SEND (its compute order): messages between
  two ranks pair in issue order on NCCL, and tensors of several edges between the same
  stages may share a communicator (`validate` checks it). With
  `lookahead` L (default 1), the receive of the j-th item is posted right after the
  WAIT of the (j-L)-th item; the first L are posted at the start of the list. So at
  most L receives per (edge, direction) are outstanding (bounded buffers), and the
  transfer of the next microbatch overlaps everything the receiver computes between
  two waits. If a hand-written schedule consumes in another order than it is sent,
  a receive is moved earlier (never later than its own WAIT nor than any later item's
  WAIT), so posts stay FIFO and always precede their waits.

What the runtime must do per action (every rank of the stage runs the same list):

=========  ================================================================================
F(mb)      run the stage forward on mb; inputs = the tensors returned by this stage's
           WAIT_F(e, mb) for each incoming e (stage 0: the data batch). Keep the outputs
           per outgoing edge for SEND_F and the autograd graph for B/I.
B(mb)      backward of mb: output gradients = WAIT_B results for each outgoing edge (last
           stage: the loss); produces input and weight gradients; release mb's graph.
I(mb)      backward for input gradients only (weight-gradient GEMMs enqueued in the
           stage's weight-grad store under mb); keep what W needs.
W(mb)      run the weight-gradient work queued for mb; release mb's activations.
SEND_F     ``h = fwd_resharder[e].start(out[e][mb])``; keep h (and the tensor) until
           h.wait(); wait all pending send handles at the latest at the end of the step
           (or earlier, e.g. to free the buffer: a send completes without any further
           action of the sender, so waiting it never deadlocks once the receiver posted).
RECV_F     ``recv[(e, 'F', mb)] = fwd_resharder[e].start(None)`` on the receiver ranks —
           non-blocking post.
WAIT_F     ``x = recv.pop((e, 'F', mb)).wait()`` — the only blocking comm action.
SEND_B/RECV_B/WAIT_B  the same with bwd_resharder[e] (e.dst's mesh -> e.src's mesh) and
           the gradient of e's tensor.
=========  ================================================================================

Guarantees checked by `validate`: for every (edge, direction) the sender's SENDs and the
receiver's RECVs list the microbatches in the same order, so a matched-pair/collective
executor that pairs the n-th start() on the sender ranks with the n-th start() on the
receiver ranks (per-Resharder FIFO, e.g. gloo's (pair, tag) matching) pairs the right
tensors; every RECV precedes its WAIT, every WAIT precedes its consumer, every SEND
follows its producer. With non-blocking SEND/RECV, only WAITs block, and the dry run in
`validate` proves every WAIT is eventually satisfied (no deadlock). `validate(...,
rendezvous=True)` additionally proves it when a SEND blocks until its receiver has
posted the matching RECV (an executor whose send is a synchronous matched pair).
"""

from __future__ import annotations

from types import MappingProxyType

from collections import defaultdict
from typing import Mapping

from .dataflow import _consumes, _produces, local_edges
from .schedule import Action, ActionKind, Edge, PipelineGraph, Schedule, ScheduleError

__all__ = ["lower", "local_edges"]

_K = ActionKind


_SEND = MappingProxyType({"F": _K.SEND_F, "B": _K.SEND_B})
_RECV = MappingProxyType({"F": _K.RECV_F, "B": _K.RECV_B})
_WAIT = MappingProxyType({"F": _K.WAIT_F, "B": _K.WAIT_B})


def lower(schedule: Schedule, graph: PipelineGraph | None = None,
          lookahead: int | None | Mapping[tuple[Edge, str], int] = 1,
          rendezvous_safe: bool = False) -> Schedule:
    """Return a new schedule with SEND/RECV/WAIT actions for every edge and microbatch.

    `graph` defaults to `schedule.graph` (if given it must be the same graph).
    `lookahead=None` posts every receive at the start of the list (unbounded buffers,
    but then no SEND can ever wait for a post). A mapping gives it per (edge, 'F'|'B'),
    default 1. `rendezvous_safe=True` starts from `lookahead` and raises the lookahead of
    whichever (edge, direction) has a SEND stuck in a rendezvous dry run until none is
    (`ScheduleError` naming the stuck actions when no lookahead helps):
    the smallest buffers for an executor whose sends block until the receive is posted
    (chain-only 1f1b/eager-1f1b need lookahead 1 anyway; skip edges need more, about
    the number of microbatches in flight between the skip's two ends).
    """
    if rendezvous_safe:
        return _lower_rendezvous_safe(schedule, graph, lookahead)
    graph = graph if graph is not None else schedule.graph
    if graph != schedule.graph:
        raise ScheduleError(f"lower(): graph {graph} differs from the schedule's {schedule.graph}")
    if schedule.is_lowered:
        raise ScheduleError("lower(): schedule already contains communication actions")
    everything = schedule.num_microbatches * max(len(schedule.stages_of(m)) for m in range(schedule.num_meshes))
    per_edge: dict[tuple[Edge, str], int] = {}
    if lookahead is None:
        default = everything
    elif isinstance(lookahead, int):
        default = lookahead
    else:
        default, per_edge = 1, dict(lookahead)
    for k, v in [("default", default), *per_edge.items()]:
        if v < 1:
            raise ScheduleError(f"lower(): lookahead {v} for {k} must be >= 1")
    local = local_edges(schedule)
    mesh_of = schedule.mesh_of

    # Sender order per channel (sending mesh, receiving mesh): the order in which the producing mesh
    # computes, across every edge between the two. Messages between two ranks pair in issue order
    # (NCCL), and edges between the same meshes may share a communicator, so the receiver posts
    # receives in exactly this merged order.
    channel_order: dict[tuple[int, int], list[tuple[Edge, str, int]]] = defaultdict(list)
    for acts in schedule.actions:
        for a in acts:
            for e, d in _produces(a, graph, local):
                snd, rcv = (e.src, e.dst) if d == "F" else (e.dst, e.src)
                channel_order[(mesh_of(snd), mesh_of(rcv))].append((e, d, a.mb))

    out: list[list[Action]] = []
    for s in range(schedule.num_meshes):
        acts = schedule.actions[s]
        # Skeleton: compute actions with their waits before and sends after.
        # slots[i] holds actions inserted *before* skeleton position i (RECV posts).
        skel: list[Action] = []
        wait_pos: dict[tuple[Edge, str, int], int] = {}
        for a in acts:
            for e, d in _consumes(a, graph, local):
                wait_pos[(e, d, a.mb)] = len(skel)
                skel.append(Action(_WAIT[d], a.mb, a.stage, e))
            skel.append(a)
            for e, d in _produces(a, graph, local):
                skel.append(Action(_SEND[d], a.mb, a.stage, e))
        posts: dict[int, list[Action]] = defaultdict(list)  # before skeleton index
        for (snd, rcv), order in sorted(channel_order.items(), key=lambda kv: kv[0]):
            if rcv != s:
                continue
            missing = [item for item in order if item not in wait_pos]
            if missing:
                e, d, mb = missing[0]
                peer = e.dst if d == "F" else e.src
                raise ScheduleError(
                    f"mesh {s}: mesh {snd} sends {'activation' if d == 'F' else 'gradient'} of mb {mb} on "
                    f"edge {e} but stage {peer} never consumes it")
            # Earliest later wait (suffix minimum), so posts stay FIFO and before waits.
            wp = [wait_pos[item] for item in order]
            suffix_min = wp[:]
            for j in range(len(wp) - 2, -1, -1):
                suffix_min[j] = min(wp[j], suffix_min[j + 1])
            # lookahead per (edge, dir): the j-th item of an edge is posted after the (j-L)-th one's wait
            seen_of: dict[tuple[Edge, str], list[int]] = defaultdict(list)
            prev = 0
            for j, (e, d, mb) in enumerate(order):
                mine = seen_of[(e, d)]
                L = per_edge.get((e, d), default)
                want = 0 if len(mine) < L else wp[mine[len(mine) - L]] + 1
                mine.append(j)
                pos = min(suffix_min[j], max(want, prev))
                posts[pos].append(Action(_RECV[d], mb, e.dst if d == "F" else e.src, e))
                prev = pos
        lowered: list[Action] = []
        for i, a in enumerate(skel):
            lowered.extend(posts.get(i, ()))
            lowered.append(a)
        lowered.extend(posts.get(len(skel), ()))
        out.append(lowered)
    return Schedule(graph, schedule.num_microbatches, out, schedule.name, schedule.placement)


def _lower_rendezvous_safe(schedule: Schedule, graph: PipelineGraph | None,
                           lookahead: int | None | Mapping[tuple[Edge, str], int]) -> Schedule:
    from .validate import dry_run  # validate imports this module

    graph = graph if graph is not None else schedule.graph
    if lookahead is None or isinstance(lookahead, int):
        base = 1 if lookahead is None else lookahead
        per: dict[tuple[Edge, str], int] = {(e, d): base for e in graph.edges for d in "FB"}
    else:
        per = {(e, d): 1 for e in graph.edges for d in "FB"} | dict(lookahead)
    cap = schedule.num_microbatches * max(len(schedule.stages_of(m)) for m in range(schedule.num_meshes))
    while True:
        low = lower(schedule, graph, per)
        stuck = dry_run(low, graph, rendezvous=True)
        blocked = {(a.edge, a.kind.direction) for _, _, a, _ in stuck
                   if a.kind in (_K.SEND_F, _K.SEND_B)}
        if not stuck:
            return low
        grow = [k for k in blocked if per[k] < cap]
        if not grow:  # not caused by receive posting: the compute order itself deadlocks
            raised = sorted(((e, d), v) for (e, d), v in per.items() if v > 1)
            lines = [f"  stage {st} step {i}: {a} waits for {why}" for st, i, a, why in stuck]
            looks = ", ".join(f"{e} {d}: {v}" for (e, d), v in raised) or "all 1"
            raise ScheduleError(
                f"lower(rendezvous_safe=True): {len(stuck)} stage(s) stay stuck under rendezvous sends "
                f"whatever the receive lookahead (up to {cap}; raised: {looks}), so the compute order "
                f"itself deadlocks:\n" + "\n".join(lines))
        for k in grow:
            per[k] += 1
