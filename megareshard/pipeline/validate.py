"""Validate a schedule (compute-only or lowered) against its graph, including a dry run.

Why a dry run and not just local order checks: cross-stage dependencies ("F3 on stage 2
after F3 on stage 1") are only meaningful relative to what each stage is blocked on, and
a deadlock is a global property. The dry run executes every stage's list in order with
the runtime's blocking rules and reports, if it gets stuck, what each stage waits for.

Blocking rules of the dry run:

* compute-only schedule: F(mb) on s waits until F(mb) ran on the src of every incoming
  edge; B/I(mb) on s waits until B/I(mb) ran on the dst of every outgoing edge.
* lowered schedule: only WAIT blocks, until the peer has executed the matching SEND.
  With ``rendezvous=True`` a SEND additionally blocks until the receiver has posted the
  matching RECV (a synchronous matched-pair executor). Local checks guarantee that each
  compute's inputs were waited for earlier in its own list.
"""

from __future__ import annotations

from collections import defaultdict

from .lowering import _consumes, _produces
from .schedule import Action, ActionKind, PipelineGraph, Schedule, ScheduleError

__all__ = ["validate", "dry_run"]

_K = ActionKind
_SENDS = (_K.SEND_F, _K.SEND_B)
_RECVS = (_K.RECV_F, _K.RECV_B)
_WAITS = (_K.WAIT_F, _K.WAIT_B)


def _where(s: int, i: int, a: Action) -> str:
    return f"stage {s} step {i}: {a}"


def _check_shape(schedule: Schedule, graph: PipelineGraph) -> None:
    m = schedule.num_microbatches
    edges = set(graph.edges)
    for s, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.stage != s:
                raise ScheduleError(f"{_where(s, i, a)} belongs to stage {a.stage}")
            if a.mb >= m:
                raise ScheduleError(f"{_where(s, i, a)}: microbatch {a.mb} out of range "
                                    f"(num_microbatches={m})")
            if a.edge is not None and a.edge not in edges:
                raise ScheduleError(f"{_where(s, i, a)}: edge {a.edge} is not in the graph")


def _check_compute(schedule: Schedule) -> None:
    """Exactly one F and one B (or I + W) per microbatch; B/I after F; W after I."""
    m = schedule.num_microbatches
    for s, acts in enumerate(schedule.actions):
        first: dict[tuple[ActionKind, int, int], int] = {}
        for i, a in enumerate(acts):
            if not a.kind.is_compute:
                continue
            key = (a.kind, a.mb, a.chunk)
            if key in first:
                raise ScheduleError(f"{_where(s, i, a)}: duplicate {a} (first at step {first[key]})")
            first[key] = i
            need = {_K.B: _K.F, _K.I: _K.F, _K.W: _K.I}.get(a.kind)
            if need is not None and (need, a.mb, a.chunk) not in first:
                what = "W before I" if a.kind == _K.W else f"{a.kind.value} before F"
                raise ScheduleError(f"{_where(s, i, a)} before its {need.value}{a.mb} "
                                    f"({what} of the same microbatch)")
            if a.kind in (_K.B, _K.I) and any(
                    (k, a.mb, a.chunk) in first for k in (_K.B, _K.I) if k != a.kind):
                raise ScheduleError(f"{_where(s, i, a)}: microbatch {a.mb} has both B and I")
        chunks = {c for (_, _, c) in first} or {0}
        for c in sorted(chunks):
            for mb in range(m):
                sfx = f"c{c}" if c else ""
                if (_K.F, mb, c) not in first:
                    raise ScheduleError(f"stage {s}: microbatch {mb}{sfx} has no F (missing microbatch)")
                has_b, has_i = (_K.B, mb, c) in first, (_K.I, mb, c) in first
                if not has_b and not has_i:
                    raise ScheduleError(f"stage {s}: microbatch {mb}{sfx} has no B (or I)")
                if has_i and (_K.W, mb, c) not in first:
                    raise ScheduleError(f"stage {s}: microbatch {mb}{sfx} has I{mb} but no W{mb}")
                if has_b and (_K.W, mb, c) in first:
                    raise ScheduleError(f"stage {s}: microbatch {mb}{sfx} has both B and W")


def _check_comm(schedule: Schedule, graph: PipelineGraph) -> None:
    """Every consumed tensor is waited for, every produced tensor sent, posts FIFO."""
    send_seq: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    recv_seq: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for s, acts in enumerate(schedule.actions):
        seen: dict[tuple, int] = {}  # (kind, edge, mb, chunk) -> step
        computed: set[tuple[ActionKind, int, int]] = set()
        for i, a in enumerate(acts):
            if a.kind.is_compute:
                for e, d in _consumes(a, graph):
                    wk = (_K.WAIT_F if d == "F" else _K.WAIT_B, e, a.mb, a.chunk)
                    if wk not in seen:
                        w = Action(wk[0], a.mb, s, a.chunk, e)
                        raise ScheduleError(f"{_where(s, i, a)} needs {w} before it")
                computed.add((a.kind, a.mb, a.chunk))
                continue
            key = (a.kind, a.edge, a.mb, a.chunk)
            if key in seen:
                raise ScheduleError(f"{_where(s, i, a)}: duplicate {a} (first at step {seen[key]})")
            seen[key] = i
            d = a.kind.direction
            if a.kind in _SENDS:
                producers = (_K.F,) if d == "F" else (_K.B, _K.I)
                if not any((k, a.mb, a.chunk) in computed for k in producers):
                    raise ScheduleError(f"{_where(s, i, a)} before the compute that produces it")
                send_seq[(a.edge, d)].append((a.mb, a.chunk))
            elif a.kind in _RECVS:
                recv_seq[(a.edge, d)].append((a.mb, a.chunk))
            else:
                rk = (_K.RECV_F if d == "F" else _K.RECV_B, a.edge, a.mb, a.chunk)
                if rk not in seen:
                    r = Action(rk[0], a.mb, s, a.chunk, a.edge)
                    raise ScheduleError(f"{_where(s, i, a)} without an earlier {r}")
        # Every produced tensor sent; every posted receive waited; no stray waits.
        for (kind, mb, c) in computed:
            for e, d in _produces(Action(kind, mb, s, c), graph):
                sk = (_K.SEND_F if d == "F" else _K.SEND_B, e, mb, c)
                if sk not in seen:
                    raise ScheduleError(f"stage {s}: {Action(kind, mb, s, c)} produces a tensor "
                                        f"for edge {e} but there is no {Action(sk[0], mb, s, c, e)}")
        for (kind, e, mb, c), i in seen.items():
            if kind in _RECVS:
                wk = (_K.WAIT_F if kind == _K.RECV_F else _K.WAIT_B, e, mb, c)
                if wk not in seen:
                    raise ScheduleError(f"{_where(s, i, acts[i])} is never waited for")
            if kind in _WAITS:
                consumer = (_K.F,) if kind == _K.WAIT_F else (_K.B, _K.I)
                if not any((k, mb, c) in computed for k in consumer):
                    raise ScheduleError(f"{_where(s, i, acts[i])}: no compute consumes it")
    for key in set(send_seq) | set(recv_seq):
        e, d = key
        snd, rcv = send_seq.get(key, []), recv_seq.get(key, [])
        if snd != rcv:
            src, dst = (e.src, e.dst) if d == "F" else (e.dst, e.src)
            raise ScheduleError(
                f"edge {e} {'activations' if d == 'F' else 'gradients'}: stage {src} sends "
                f"microbatches {[mb for mb, _ in snd]} but stage {dst} posts receives "
                f"{[mb for mb, _ in rcv]}; per-edge FIFO matching needs the same order")
    _check_channels(schedule)


def _check_channels(schedule: Schedule) -> None:
    """Per (sending stage, receiving stage) — one channel, whatever edges it carries — the receiver posts
    its receives in the order the sender issues its sends. NCCL pairs messages between two ranks in issue
    order, and tensors of different edges between the same stages may share a communicator."""
    sends: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    for s, acts in enumerate(schedule.actions):
        for a in acts:
            if a.kind in _SENDS:
                sends[(s, a.peer)].append((str(a.edge), a.kind.direction, a.mb, a.chunk))
            elif a.kind in _RECVS:
                recvs[(a.peer, s)].append((str(a.edge), a.kind.direction, a.mb, a.chunk))
    for ch in sorted(set(sends) | set(recvs)):
        snd, rcv = sends.get(ch, []), recvs.get(ch, [])
        if snd != rcv:
            k = next((i for i, (x, y) in enumerate(zip(snd, rcv)) if x != y), min(len(snd), len(rcv)))
            raise ScheduleError(
                f"stage {ch[0]} -> stage {ch[1]}: send #{k} is {snd[k] if k < len(snd) else 'missing'} but "
                f"receive #{k} is {rcv[k] if k < len(rcv) else 'missing'} (edge, direction, mb, chunk); "
                "messages between two stages pair in issue order (NCCL), so receives must follow the sends")


def _blocker(a: Action, graph: PipelineGraph, done: set, posted: set,
             rendezvous: bool) -> str | None:
    """Why `a` cannot run now (None if it can). `done` holds executed action keys."""
    if a.kind.is_compute:
        if a.kind == _K.F:
            deps = [(e.src, "F", e) for e in graph.in_edges(a.stage)]
        elif a.kind in (_K.B, _K.I):
            deps = [(e.dst, "B", e) for e in graph.out_edges(a.stage)]
        else:
            return None
        for peer, d, e in deps:
            if (peer, d, a.mb, a.chunk) not in done:
                what = f"F{a.mb}" if d == "F" else f"B{a.mb}/I{a.mb}"
                return f"{what} on stage {peer} (edge {e})"
        return None
    if a.kind in _WAITS:
        if (a.peer, "S", a.edge, a.kind.direction, a.mb, a.chunk) not in done:
            send = _K.SEND_F if a.kind == _K.WAIT_F else _K.SEND_B
            return f"{Action(send, a.mb, a.peer, a.chunk, a.edge)} on stage {a.peer}"
        return None
    if a.kind in _SENDS and rendezvous:
        if (a.edge, a.kind.direction, a.mb, a.chunk) not in posted:
            recv = _K.RECV_F if a.kind == _K.SEND_F else _K.RECV_B
            return f"{Action(recv, a.mb, a.peer, a.chunk, a.edge)} posted on stage {a.peer} (rendezvous)"
    return None


def dry_run(schedule: Schedule, graph: PipelineGraph | None = None,
            rendezvous: bool = False) -> list[tuple[int, int, Action, str]]:
    """Execute every list with the blocking rules above; return the stuck stages as
    (stage, step, action, what it waits for) — empty when every stage finishes."""
    graph = graph if graph is not None else schedule.graph
    P = graph.num_stages
    pc = [0] * P
    done: set = set()
    posted: set = set()
    progress = True
    while progress:
        progress = False
        for s in range(P):
            acts = schedule.actions[s]
            while pc[s] < len(acts):
                a = acts[pc[s]]
                if _blocker(a, graph, done, posted, rendezvous) is not None:
                    break
                if a.kind == _K.F:
                    done.add((s, "F", a.mb, a.chunk))
                elif a.kind in (_K.B, _K.I):
                    done.add((s, "B", a.mb, a.chunk))
                elif a.kind in _SENDS:
                    done.add((s, "S", a.edge, a.kind.direction, a.mb, a.chunk))
                elif a.kind in _RECVS:
                    posted.add((a.edge, a.kind.direction, a.mb, a.chunk))
                pc[s] += 1
                progress = True
    return [(s, pc[s], schedule.actions[s][pc[s]],
             str(_blocker(schedule.actions[s][pc[s]], graph, done, posted, rendezvous)))
            for s in range(P) if pc[s] < len(schedule.actions[s])]


def _check_deadlock(schedule: Schedule, graph: PipelineGraph, rendezvous: bool) -> None:
    stuck = dry_run(schedule, graph, rendezvous)
    if stuck:
        lines = [f"  {_where(s, i, a)} waits for {why}" for s, i, a, why in stuck]
        finished = sorted(set(range(graph.num_stages)) - {s for s, _, _, _ in stuck})
        tail = f"\n  (finished: stages {finished})" if finished else ""
        mode = "rendezvous sends" if rendezvous else "non-blocking sends"
        raise ScheduleError(f"deadlock ({mode}): no stage can make progress\n"
                            + "\n".join(lines) + tail)


def validate(schedule: Schedule, graph: PipelineGraph | None = None,
             rendezvous: bool = False) -> None:
    """Raise `ScheduleError` (stage, step, action in the message) unless the schedule is
    complete, ordered and deadlock-free. Works on compute-only and lowered schedules."""
    graph = graph if graph is not None else schedule.graph
    if graph != schedule.graph:
        raise ScheduleError(f"validate(): graph {graph} differs from the schedule's {schedule.graph}")
    _check_shape(schedule, graph)
    _check_compute(schedule)
    if schedule.is_lowered:
        _check_comm(schedule, graph)
    _check_deadlock(schedule, graph, rendezvous)
