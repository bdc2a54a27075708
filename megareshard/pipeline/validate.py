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

from .dataflow import _consumes, _produces, local_edges
from .schedule import Action, ActionKind, PipelineGraph, Schedule, ScheduleError

__all__ = ["validate", "dry_run"]

_K = ActionKind
_SENDS = (_K.SEND_F, _K.SEND_B)
_RECVS = (_K.RECV_F, _K.RECV_B)
_WAITS = (_K.WAIT_F, _K.WAIT_B)


def _txt(s: int, a: Action) -> str:
    """An action as its program writes it: ``@stage`` only where the mesh runs another stage's action."""
    return a.text(a.stage != s)


def _where(s: int, i: int, a: Action) -> str:
    return f"stage {s} step {i}: {a}" if a.stage == s else f"mesh {s} step {i}: {a.text(True)}"


def _err(s: int, i: int, a: Action, rest: str, why: str | None = None) -> ScheduleError:
    """``ScheduleError(_where(...) + rest)`` that also carries the location (mesh, index, action text, why)."""
    why = why if why is not None else rest.lstrip(":").strip()
    return ScheduleError(f"{_where(s, i, a)}{rest}", mesh=s, index=i, action=a.text(True), why=why)


def _check_shape(schedule: Schedule, graph: PipelineGraph) -> None:
    m = schedule.num_microbatches
    edges = set(graph.edges)
    for s, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if not 0 <= a.stage < graph.num_stages or schedule.mesh_of(a.stage) != s:
                where = "no stage" if not 0 <= a.stage < graph.num_stages else f"mesh {schedule.mesh_of(a.stage)}"
                raise _err(s, i, a, f" belongs to stage {a.stage} ({where}), not to mesh {s}")
            if a.mb >= m:
                raise _err(s, i, a, f": microbatch {a.mb} out of range (num_microbatches={m})")
            if a.edge is not None and a.edge not in edges:
                raise _err(s, i, a, f": edge {a.edge} is not in the graph")


def _check_compute(schedule: Schedule) -> None:
    """Exactly one F and one B (or I + W) per stage and microbatch; B/I after F; W after I."""
    m = schedule.num_microbatches
    first: dict[tuple[ActionKind, int, int], tuple[int, int]] = {}  # (kind, stage, mb) -> (program, step)
    for s, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if not a.kind.is_compute:
                continue
            key = (a.kind, a.stage, a.mb)
            if key in first:
                raise _err(s, i, a, f": duplicate {_txt(s, a)} (first at step {first[key][1]})")
            first[key] = (s, i)
            need = {_K.B: _K.F, _K.I: _K.F, _K.W: _K.I}.get(a.kind)
            if need is not None and (need, a.stage, a.mb) not in first:
                what = "W before I" if a.kind == _K.W else f"{a.kind.value} before F"
                why = ("weight gradient before its input gradient" if a.kind == _K.W
                       else "backward before its forward")
                raise _err(s, i, a, f" before its {need.value}{a.mb} ({what} of the same microbatch)",
                           f"{why} ({need.value}{a.mb}@{a.stage} is not earlier)")
            if a.kind in (_K.B, _K.I) and any(
                    (k, a.stage, a.mb) in first for k in (_K.B, _K.I) if k != a.kind):
                raise _err(s, i, a, f": microbatch {a.mb} has both B and I")
    for st in range(schedule.num_stages):
        for mb in range(m):
            if (_K.F, st, mb) not in first:
                raise ScheduleError(f"stage {st}: microbatch {mb} has no F (missing microbatch)")
            has_b, has_i = (_K.B, st, mb) in first, (_K.I, st, mb) in first
            if not has_b and not has_i:
                raise ScheduleError(f"stage {st}: microbatch {mb} has no B (or I)")
            if has_i and (_K.W, st, mb) not in first:
                raise ScheduleError(f"stage {st}: microbatch {mb} has I{mb} but no W{mb}")
            if has_b and (_K.W, st, mb) in first:
                raise ScheduleError(f"stage {st}: microbatch {mb} has both B and W")


def _check_comm(schedule: Schedule, graph: PipelineGraph) -> None:
    """Every consumed tensor is waited for (or handed off locally after its producer), every produced
    tensor sent, posts FIFO."""
    local = local_edges(schedule)
    send_seq: dict[tuple, list[int]] = defaultdict(list)
    recv_seq: dict[tuple, list[int]] = defaultdict(list)
    for s, acts in enumerate(schedule.actions):
        seen: dict[tuple, int] = {}  # (kind, edge, mb) -> step
        computed: set[tuple[ActionKind, int, int]] = set()  # (kind, stage, mb)
        for i, a in enumerate(acts):
            if a.kind.is_compute:
                for e, d in _consumes(a, graph, local):
                    wk = (_K.WAIT_F if d == "F" else _K.WAIT_B, e, a.mb)
                    if wk not in seen:
                        w = Action(wk[0], a.mb, a.stage, e)
                        raise _err(s, i, a, f" needs {w} before it")
                computed.add((a.kind, a.stage, a.mb))
                continue
            if a.kind.is_reduce:
                continue
            key = (a.kind, a.edge, a.mb)
            if key in seen:
                raise _err(s, i, a, f": duplicate {a} (first at step {seen[key]})")
            if a.edge in local:
                raise _err(s, i, a, f": edge {a.edge} joins two stages of mesh {s}: a local "
                           "hand-off has no communication")
            seen[key] = i
            d = a.kind.direction
            if a.kind in _SENDS:
                producers = (_K.F,) if d == "F" else (_K.B, _K.I)
                if not any((k, a.stage, a.mb) in computed for k in producers):
                    raise _err(s, i, a, " before the compute that produces it")
                send_seq[(a.edge, d)].append(a.mb)
            elif a.kind in _RECVS:
                recv_seq[(a.edge, d)].append(a.mb)
            else:
                rk = (_K.RECV_F if d == "F" else _K.RECV_B, a.edge, a.mb)
                if rk not in seen:
                    r = Action(rk[0], a.mb, a.stage, a.edge)
                    raise _err(s, i, a, f" without an earlier {r}")
        # Every produced tensor sent; every posted receive waited; no stray waits.
        for (kind, st, mb) in computed:
            for e, d in _produces(Action(kind, mb, st), graph, local):
                sk = (_K.SEND_F if d == "F" else _K.SEND_B, e, mb)
                if sk not in seen:
                    raise ScheduleError(f"stage {s}: {_txt(s, Action(kind, mb, st))} produces a tensor "
                                        f"for edge {e} but there is no {Action(sk[0], mb, st, e)}")
        for (kind, e, mb), i in seen.items():
            if kind in _RECVS:
                wk = (_K.WAIT_F if kind == _K.RECV_F else _K.WAIT_B, e, mb)
                if wk not in seen:
                    raise _err(s, i, acts[i], " is never waited for")
            if kind in _WAITS:
                consumer = (_K.F,) if kind == _K.WAIT_F else (_K.B, _K.I)
                me = acts[i].stage
                if not any((k, me, mb) in computed for k in consumer):
                    raise _err(s, i, acts[i], ": no compute consumes it")
    for key in set(send_seq) | set(recv_seq):
        e, d = key
        snd, rcv = send_seq.get(key, []), recv_seq.get(key, [])
        if snd != rcv:
            src, dst = (e.src, e.dst) if d == "F" else (e.dst, e.src)
            raise ScheduleError(
                f"edge {e} {'activations' if d == 'F' else 'gradients'}: stage {src} sends "
                f"microbatches {snd} but stage {dst} posts receives "
                f"{rcv}; per-edge FIFO matching needs the same order")
    _check_channels(schedule)


def _check_local(schedule: Schedule) -> None:
    """A local hand-off (an edge between two stages of one mesh) needs its producer earlier in the program."""
    local = local_edges(schedule)
    if not local:
        return
    for s, acts in enumerate(schedule.actions):
        computed: set[tuple[ActionKind, int, int]] = set()
        for i, a in enumerate(acts):
            if not a.kind.is_compute:
                continue
            for e in local:
                if a.kind == _K.F and e.dst == a.stage and (_K.F, e.src, a.mb) not in computed:
                    raise _err(s, i, a, f" before F{a.mb}@{e.src}, the local producer of edge {e}")
                if a.kind in (_K.B, _K.I) and e.src == a.stage and not any(
                        (k, e.dst, a.mb) in computed for k in (_K.B, _K.I)):
                    raise _err(s, i, a, f" before B/I{a.mb}@{e.dst}, the local producer of edge {e}'s gradient")
            computed.add((a.kind, a.stage, a.mb))


def _check_reduce(schedule: Schedule) -> None:
    """R (a stage's data-parallel gradient reduction): none at all, or exactly one per stage, after every
    backward (B, I and W) of that stage in its program — the reduction reads the finished gradients."""
    where: dict[int, tuple[int, int, Action]] = {}
    last_bwd: dict[int, tuple[int, Action]] = {}
    for s, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.kind.is_reduce:
                if a.stage in where:
                    raise _err(s, i, a, f": a second R of stage {a.stage} (first at step {where[a.stage][1]})",
                               f"stage {a.stage} reduces its gradients twice (first at action {where[a.stage][1]})")
                where[a.stage] = (s, i, a)
            elif a.kind in (_K.B, _K.I, _K.W):
                if a.stage in where:
                    rs, ri, ra = where[a.stage]
                    raise _err(rs, ri, ra, f" before {_txt(rs, a)} (step {i}): the gradient reduction must "
                               "follow the stage's last backward",
                               f"gradient reduction before the stage's last backward ({a.text(True)} at "
                               f"action {i})")
                last_bwd[a.stage] = (i, a)
    if where:
        missing = [st for st in range(schedule.num_stages) if st not in where]
        if missing:
            raise ScheduleError(f"stage(s) {missing} have no R while stage(s) {sorted(where)} do: with R actions "
                                "every stage reduces its gradients through one")


def _check_channels(schedule: Schedule) -> None:
    """Per (sending mesh, receiving mesh) — one channel, whatever edges it carries — the receiver posts
    its receives in the order the sender issues its sends. NCCL pairs messages between two ranks in issue
    order, and tensors of different edges between the same meshes may share a communicator."""
    sends: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    for s, acts in enumerate(schedule.actions):
        for a in acts:
            if a.kind in _SENDS:
                sends[(s, schedule.mesh_of(a.peer))].append((str(a.edge), a.kind.direction, a.mb))
            elif a.kind in _RECVS:
                recvs[(schedule.mesh_of(a.peer), s)].append((str(a.edge), a.kind.direction, a.mb))
    for ch in sorted(set(sends) | set(recvs)):
        snd, rcv = sends.get(ch, []), recvs.get(ch, [])
        if snd != rcv:
            k = next((i for i, (x, y) in enumerate(zip(snd, rcv)) if x != y), min(len(snd), len(rcv)))
            raise ScheduleError(
                f"mesh {ch[0]} -> mesh {ch[1]}: send #{k} is {snd[k] if k < len(snd) else 'missing'} but "
                f"receive #{k} is {rcv[k] if k < len(rcv) else 'missing'} (edge, direction, mb); "
                "messages between two meshes pair in issue order (NCCL), so receives must follow the sends")


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
            if (peer, d, a.mb) not in done:
                what = f"F{a.mb}" if d == "F" else f"B{a.mb}/I{a.mb}"
                return f"{what} on stage {peer} (edge {e})"
        return None
    if a.kind in _WAITS:
        if (a.peer, "S", a.edge, a.kind.direction, a.mb) not in done:
            send = _K.SEND_F if a.kind == _K.WAIT_F else _K.SEND_B
            return f"{Action(send, a.mb, a.peer, a.edge)} on stage {a.peer}"
        return None
    if a.kind in _SENDS and rendezvous:
        if (a.edge, a.kind.direction, a.mb) not in posted:
            recv = _K.RECV_F if a.kind == _K.SEND_F else _K.RECV_B
            return f"{Action(recv, a.mb, a.peer, a.edge)} posted on stage {a.peer} (rendezvous)"
    return None


def dry_run(schedule: Schedule, graph: PipelineGraph | None = None,
            rendezvous: bool = False) -> list[tuple[int, int, Action, str]]:
    """Execute every program with the blocking rules above; return the stuck programs as
    (mesh, step, action, what it waits for) — empty when every program finishes."""
    graph = graph if graph is not None else schedule.graph
    M = schedule.num_meshes
    pc = [0] * M
    done: set = set()
    posted: set = set()
    progress = True
    while progress:
        progress = False
        for s in range(M):
            acts = schedule.actions[s]
            while pc[s] < len(acts):
                a = acts[pc[s]]
                if _blocker(a, graph, done, posted, rendezvous) is not None:
                    break
                if a.kind == _K.F:
                    done.add((a.stage, "F", a.mb))
                elif a.kind in (_K.B, _K.I):
                    done.add((a.stage, "B", a.mb))
                elif a.kind in _SENDS:
                    done.add((a.stage, "S", a.edge, a.kind.direction, a.mb))
                elif a.kind in _RECVS:
                    posted.add((a.edge, a.kind.direction, a.mb))
                pc[s] += 1
                progress = True
    return [(s, pc[s], schedule.actions[s][pc[s]],
             str(_blocker(schedule.actions[s][pc[s]], graph, done, posted, rendezvous)))
            for s in range(M) if pc[s] < len(schedule.actions[s])]


def _check_deadlock(schedule: Schedule, graph: PipelineGraph, rendezvous: bool) -> None:
    stuck = dry_run(schedule, graph, rendezvous)
    if stuck:
        lines = [f"  {_where(s, i, a)} waits for {why}" for s, i, a, why in stuck]
        finished = sorted(set(range(schedule.num_meshes)) - {s for s, _, _, _ in stuck})
        tail = f"\n  (finished: programs {finished})" if finished else ""
        mode = "rendezvous sends" if rendezvous else "non-blocking sends"
        s0, i0, a0, why0 = stuck[0]
        others = "; ".join(f"mesh {s} action {i} {a.text(True)!r} waits for {why}" for s, i, a, why in stuck[1:])
        raise ScheduleError(f"deadlock ({mode}): no program can make progress\n"
                            + "\n".join(lines) + tail, mesh=s0, index=i0, action=a0.text(True),
                            why=f"deadlock: waits for {why0}" + (f" (and {others})" if others else ""))


def validate(schedule: Schedule, graph: PipelineGraph | None = None,
             rendezvous: bool = False) -> None:
    """Raise `ScheduleError` (stage, step, action in the message) unless the schedule is
    complete, ordered and deadlock-free. Works on compute-only and lowered schedules."""
    graph = graph if graph is not None else schedule.graph
    if graph != schedule.graph:
        raise ScheduleError(f"validate(): graph {graph} differs from the schedule's {schedule.graph}")
    _check_shape(schedule, graph)
    _check_compute(schedule)
    _check_local(schedule)
    _check_reduce(schedule)
    if schedule.is_lowered:
        _check_comm(schedule, graph)
    _check_deadlock(schedule, graph, rendezvous)
