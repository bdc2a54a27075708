"""Discrete-event simulation of a (lowered) schedule: timeline, bubble, peak activations.

Model (deliberately simple, so that the numbers can be checked by hand):

* Each mesh executes its program in order (one row per mesh; with virtual stages a mesh
  runs several stages). Compute actions (F, B, I, W) take `costs.<kind>[stage]` of the
  action's stage; comm actions take no compute time; local hand-offs between two stages
  of one mesh cost nothing. Only WAIT blocks: the stage
  idles until the tensor has arrived.
* Each stage is one host with one full-duplex NIC that runs in parallel with its
  compute: a send channel and a receive channel. A transfer of edge e for mb becomes
  *ready* when its SEND executed (the tensor exists) — and, with
  ``costs.rendezvous=True``, also the receiver posted the matching RECV —; it holds the
  sender's send channel and the receiver's receive channel for `costs.comm` of the edge
  (both directions) and arrives at its end. It starts as soon as it is ready and both
  channels are free; whenever a channel frees, the waiting transfers are tried in the
  order they became ready (one whose receiver is busy does not hold back a later one to
  an idle receiver). So three tensors sent at once into one host arrive one after the
  other, as on a real NIC (the U-Transformer's last stage receives three per
  microbatch). ``costs.recv_nic=False`` leaves the receive channel out (receiving is
  free), for comparison.
* R (a stage's data-parallel gradient reduction, `grad_reduce.py`) holds its mesh's program for
  ``costs.reduce`` of its stage — 0 by default: R only launches an asynchronous reduction, which
  then runs beside the program (the model counts no NIC for it). Give it the DP all-reduce time
  to model a reduction that is not overlapped at all (the pessimistic bound). Its intervals are
  `Timeline.reduce`; they count in the makespan, not as compute.
* Bubble fraction = 1 - (sum of compute busy time) / (num_stages x makespan).
* Live activations: the activation of mb on stage s is live from the start of F(mb)
  until the end of B(mb), or with delayed weight gradients until the end of W(mb),
  since W still needs the layer inputs (I alone does not free them). Intervals are
  half-open, so a B ending when the next F starts does not overlap it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .lowering import lower
from .schedule import Action, ActionKind, Edge, PipelineGraph, Schedule, ScheduleError

__all__ = ["Costs", "Interval", "CommInterval", "Timeline", "simulate"]

_K = ActionKind
PerStage = float | Sequence[float] | Mapping[int, float]


def _per_stage(v: PerStage, stage: int, what: str) -> float:
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(v[stage])  # type: ignore[index]
    except (KeyError, IndexError):
        raise ScheduleError(f"costs.{what} has no entry for stage {stage}") from None


@dataclass(frozen=True)
class Costs:
    """Compute cost per kind (a number, or per stage: list or {stage: cost}) and comm.

    `i` and `w` default to half of `b` each (B = I + W). `comm` is a number for every
    edge, or a mapping keyed by `Edge` or its text (``"0->1"``, ``"0->3:skip"``) with an
    optional ``"*"`` default. `rendezvous`: a transfer also waits for the receiver's
    RECV. `recv_nic`: a transfer also holds the receiving stage's NIC (default; False:
    only the sender's NIC is a bottleneck). `reduce`: how long an R action holds its mesh's
    program (default 0: the reduction is launched and overlaps; the DP all-reduce time: it does not).
    `send_post` / `recv_post`: how long a SEND / RECV action holds its program before the message is posted
    (the runtime's own work to start a transfer: default 0, free); the transfer is ready when it is posted.
    `nic_sharing=False` drops the NIC channels: every transfer starts the moment it is ready and takes its
    `comm` time however many others are in flight — only the dependencies stay, so the makespan is the
    schedule's critical path (fill and drain included) with transfers that never queue.
    """

    f: PerStage = 1.0
    b: PerStage = 2.0
    i: PerStage | None = None
    w: PerStage | None = None
    comm: float | Mapping[Any, float] = 0.0
    rendezvous: bool = False
    recv_nic: bool = True
    reduce: PerStage = 0.0
    send_post: float = 0.0
    recv_post: float = 0.0
    nic_sharing: bool = True

    def compute(self, kind: ActionKind, stage: int) -> float:
        if kind == _K.F:
            return _per_stage(self.f, stage, "f")
        b = _per_stage(self.b, stage, "b")
        if kind == _K.B:
            return b
        if kind == _K.I:
            return b / 2 if self.i is None else _per_stage(self.i, stage, "i")
        if kind == _K.W:
            if self.w is not None:
                return _per_stage(self.w, stage, "w")
            i = b / 2 if self.i is None else _per_stage(self.i, stage, "i")
            return b - i
        raise ScheduleError(f"{kind.value} is not a compute kind")

    def edge(self, e: Edge) -> float:
        if isinstance(self.comm, (int, float)):
            return float(self.comm)
        for k in (e, str(e), "*"):
            if k in self.comm:
                return float(self.comm[k])
        raise ScheduleError(f"costs.comm has no entry for edge {e} (keys: {list(self.comm)})")


@dataclass(frozen=True)
class Interval:
    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class CommInterval:
    """A transfer on `sender`'s send channel; `direction` 'F' = activation, 'B' = gradient."""

    start: float
    end: float
    edge: Edge
    direction: str
    mb: int
    sender: int
    receiver: int


@dataclass
class Timeline:
    """Per-stage compute intervals, transfers, and the derived metrics."""

    num_stages: int
    compute: list[list[Interval]]
    comm: list[CommInterval] = field(default_factory=list)
    name: str = ""
    reduce: list[Interval] = field(default_factory=list)  # R actions (gradient reductions), per mesh row order

    @property
    def makespan(self) -> float:
        ends = ([iv.end for row in self.compute for iv in row] + [c.end for c in self.comm]
                + [r.end for r in self.reduce])
        starts = ([iv.start for row in self.compute for iv in row] + [c.start for c in self.comm]
                  + [r.start for r in self.reduce])
        return (max(ends) - min(starts)) if ends else 0.0

    def busy(self, stage: int) -> float:
        return sum(iv.end - iv.start for iv in self.compute[stage])

    @property
    def bubble_fraction(self) -> float:
        span = self.makespan
        if span <= 0:
            return 0.0
        return 1.0 - sum(self.busy(s) for s in range(self.num_stages)) / (self.num_stages * span)

    @property
    def peak_activations(self) -> list[int]:
        """Max number of (stage, microbatch) activations live at once, per row (per mesh: a mesh holding
        virtual stages counts each of its stages' microbatches)."""
        out = []
        for row in self.compute:
            start: dict[tuple[int, int], float] = {}
            end: dict[tuple[int, int], float] = {}
            for iv in row:
                k = (iv.action.mb, iv.action.stage)
                if iv.action.kind == _K.F:
                    start[k] = iv.start
                elif iv.action.kind in (_K.B, _K.W):
                    end[k] = iv.end
            ev = sorted([(t, 1) for t in start.values()] + [(end.get(k, float("inf")), -1)
                                                             for k in start], key=lambda x: (x[0], x[1]))
            cur = peak = 0
            for _, d in ev:
                cur += d
                peak = max(peak, cur)
            out.append(peak)
        return out

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "makespan": round(self.makespan, 6),
                "bubble_fraction": round(self.bubble_fraction, 6),
                "peak_activations": self.peak_activations}

    def to_trace(self) -> list[dict[str, Any]]:
        """The runtime's trace format: {stage, kind, mb, start, end} (+ edge/peer for comm)."""
        out: list[dict[str, Any]] = [
            {"stage": s, "kind": iv.action.kind.value, "mb": iv.action.mb,
             "start": iv.start, "end": iv.end, **({"vstage": iv.action.stage} if iv.action.stage != s else {})}
            for s, row in enumerate(self.compute) for iv in row]
        out += [{"stage": c.sender, "kind": "SEND_" + c.direction, "mb": c.mb, "start": c.start,
                 "end": c.end, "edge": str(c.edge), "peer": c.receiver} for c in self.comm]
        out += [{"stage": self._row_of(r.action.stage), "kind": "R", "mb": 0, "start": r.start, "end": r.end,
                 "vstage": r.action.stage} for r in self.reduce]
        return out

    def _row_of(self, stage: int) -> int:
        for s, row in enumerate(self.compute):
            if any(iv.action.stage == stage for iv in row):
                return s
        return stage

    @classmethod
    def from_trace(cls, records: Iterable[Mapping[str, Any]], name: str = "") -> "Timeline":
        """Build a timeline from a measured trace (compute kinds F/B/I/W; SEND_F/SEND_B
        records with optional 'edge' text and 'peer' become transfers; R records reductions; others, such
        as the MEMORY records of `--pipeline-trace`, are ignored)."""
        recs = [r for r in records if str(r.get("kind")) in ("F", "B", "I", "W", "SEND_F", "SEND_B", "R")]
        if not recs:
            raise ScheduleError("empty trace")
        P = 1 + max(int(r["stage"]) for r in recs)
        compute: list[list[Interval]] = [[] for _ in range(P)]
        comm: list[CommInterval] = []
        reduce: list[Interval] = []
        for r in recs:
            s, kind, mb = int(r["stage"]), str(r["kind"]), int(r["mb"])
            t0, t1 = float(r["start"]), float(r["end"])
            if kind == "R":
                reduce.append(Interval(t0, t1, Action(_K.R, 0, int(r.get("vstage", s)))))
            elif kind in ("F", "B", "I", "W"):
                compute[s].append(Interval(t0, t1, Action(_K(kind), mb, int(r.get("vstage", s)))))
            elif kind in ("SEND_F", "SEND_B"):
                d = kind[-1]
                peer = int(r.get("peer", s + 1 if d == "F" else max(s - 1, 0)))
                text = str(r.get("edge", ""))
                if text:
                    src, rest = text.split("->")
                    dst, _, nm = rest.partition(":")
                    edge = Edge(int(src), int(dst), nm)
                else:
                    edge = Edge(min(s, peer), max(s, peer)) if s != peer else Edge(s, s + 1)
                comm.append(CommInterval(t0, t1, edge, d, mb, s, peer))
        for row in compute:
            row.sort(key=lambda iv: iv.start)
        return cls(P, compute, comm, name, reduce)


def simulate(schedule: Schedule, graph: PipelineGraph | None = None,
             costs: Costs | Mapping[str, Any] | None = None, lookahead: int = 1) -> Timeline:
    """Simulate `schedule` (lowered first if it has no comm actions) under `costs`.

    `costs` may be a `Costs` or a mapping with keys f/b/i/w/comm/rendezvous (upper-case
    F/B/I/W accepted).
    """
    graph = graph if graph is not None else schedule.graph
    if costs is None:
        costs = Costs()
    elif not isinstance(costs, Costs):
        costs = Costs(**{str(k).lower(): v for k, v in costs.items()})
    sched = schedule if schedule.is_lowered else lower(schedule, graph, lookahead=lookahead)
    P = sched.num_meshes  # one row (program, NIC) per mesh; a mesh may run several stages
    mesh_of = sched.mesh_of
    acts = sched.actions

    pc = [0] * P
    compute: list[list[Interval]] = [[] for _ in range(P)]
    comm: list[CommInterval] = []
    reduce: list[Interval] = []
    sent: dict[tuple, float] = {}
    posted: dict[tuple, float] = {}
    arrived: dict[tuple, float] = {}
    waiting: dict[tuple, int] = {}
    send_free = [0.0] * P  # when each stage's send channel is free
    recv_free = [0.0] * P  # ... and its receive channel
    pending: list[tuple[tuple, Action]] = []  # ready transfers, in the order they became ready
    events: list[tuple[float, int, int, str, Any]] = []
    seq = 0

    def push(t: float, prio: int, kind: str, arg: Any) -> None:
        nonlocal seq
        heapq.heappush(events, (t, prio, seq, kind, arg))
        seq += 1

    def try_ready(key: tuple, t: float, send: Action) -> None:
        if key in queued:
            return
        if key in sent and (key in posted or not costs.rendezvous):
            queued.add(key)
            pending.append((key, send))  # events come in time order: the list stays in ready order
            push(t, 1, "nic", None)

    def dispatch(t: float) -> None:
        """Start every waiting transfer whose sender's and receiver's channels are free at t."""
        keep = []
        for key, send in pending:
            src, dst = mesh_of(send.stage), mesh_of(send.peer)
            if not costs.nic_sharing or (send_free[src] <= t and (not costs.recv_nic or recv_free[dst] <= t)):
                end = t + costs.edge(send.edge)
                send_free[src] = end
                if costs.recv_nic:
                    recv_free[dst] = end
                comm.append(CommInterval(t, end, send.edge, send.kind.direction, send.mb, src, dst))
                arrived[key] = end
                push(end, 0, "arrive", key)
                push(end, 1, "nic", None)
            else:
                keep.append((key, send))
        pending[:] = keep

    def run(s: int, t: float) -> None:
        while pc[s] < len(acts[s]):
            a = acts[s][pc[s]]
            if a.kind.is_reduce:
                end = t + _per_stage(costs.reduce, a.stage, "reduce")
                reduce.append(Interval(t, end, a))
                pc[s] += 1
                if end > t:
                    push(end, 2, "run", s)
                    return
                continue
            if a.kind.is_compute:
                end = t + costs.compute(a.kind, a.stage)
                compute[s].append(Interval(t, end, a))
                pc[s] += 1
                push(end, 2, "run", s)
                return
            key = a.key
            post = (costs.send_post if a.kind in (_K.SEND_F, _K.SEND_B) else
                    costs.recv_post if a.kind in (_K.RECV_F, _K.RECV_B) else 0.0)
            if post > 0 and posting.get(s) != pc[s]:  # the program posts the message first
                posting[s] = pc[s]
                push(t + post, 2, "run", s)
                return
            if a.kind in (_K.SEND_F, _K.SEND_B):
                sent[key] = t
                sender_of[key] = a
                try_ready(key, t, a)
            elif a.kind in (_K.RECV_F, _K.RECV_B):
                posted[key] = t
                if key in sent:
                    try_ready(key, t, sender_of[key])
            elif key in arrived:
                if arrived[key] > t:  # in flight: resume when it lands
                    push(arrived[key], 2, "run", s)
                    return
            else:
                waiting[key] = s
                return
            pc[s] += 1

    sender_of: dict[tuple, Action] = {}
    queued: set[tuple] = set()
    posting: dict[int, int] = {}  # program -> the step whose message it is posting (send_post / recv_post)
    for s in range(P):
        push(0.0, 2, "run", s)
    while events:
        t, _, _, kind, arg = heapq.heappop(events)
        if kind == "run":
            run(arg, t)
        elif kind == "nic":
            dispatch(t)
        elif kind == "arrive":
            if arg in waiting:
                push(t, 2, "run", waiting.pop(arg))
    stuck = [s for s in range(P) if pc[s] < len(acts[s])]
    if stuck:
        raise ScheduleError("simulate: deadlock; " + "; ".join(
            f"program {s} step {pc[s]}: {acts[s][pc[s]].text(True)}" for s in stuck)
            + " (run validate() for a full report)")
    return Timeline(P, compute, comm, schedule.name, reduce)
