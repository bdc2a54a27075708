"""When the runtime posts each receive and retires each send, and NCCL's model of it (pure: no torch).

**Posting modes** (``--pipeline-recv-posting``):

* ``early`` (gloo only): a receive is posted at its RECV action, where the lowering put it (per channel in
  the sender's order, ``lookahead`` ahead of its WAIT), so the sender's transfer can start as soon as the
  tensor exists. gloo matches each message on its own, so an early receive never holds back a send.
* ``grouped`` (required on NCCL): on a communicator that carries both directions between two meshes (two
  one-rank ends: `comm.shared_mesh_pairs`), NCCL runs a rank's operations in issue order, so a receive posted
  early would sit in front of the sends issued after it and wait for its data first. There a receive is posted
  **together with the last send to the same peer before its WAIT** — one group, the exchange torch's
  ``Schedule1F1B`` does with ``batch_isend_irecv`` — provided no other send to that peer comes between; else
  at the WAIT. Whatever is posted, the channel's earlier receives that are not yet posted go with it (issue
  order is the pairing). Between the send and the WAIT nothing else is issued on that communicator, so the
  group only lets operations run together that would otherwise run one after the other. On a communicator
  that carries one direction, receives are posted early as above: nothing of this rank queues behind them.

**Retiring sends.** gloo reports a send complete only to whoever waits for it, so the runtime waits for it
where its completion is already known: right after the first action of the sender's program that causally
follows the receiver's WAIT (a vector clock over the lowered programs: a message the receiver sent after its
WAIT has arrived) — for a forward activation, at the latest the WAIT for its gradient, so it is freed before
the backward runs; otherwise at the end of the step. No thread waits for sends.

**NCCL's model** (`nccl_dry_run`): each mesh's operations on a communicator run in issue order, a group's
together; a point-to-point operation completes only when its peer's matching operation runs; only WAIT
blocks a program. Every mesh pair is modelled as one communicator per shared pair (the conservative merge
of the real, per-participant-set ones: splitting a queue only removes waiting) and one per direction
otherwise. A schedule that deadlocks there is refused at start-up, naming the stuck action and what its
receive queues behind.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Iterable

from .schedule import Action, ActionKind, Edge, Schedule, ScheduleError

__all__ = ["MODES", "PostingPlan", "plan_posting", "two_way_pairs", "split_pairs", "retire_points", "held_sends_peak",
           "nccl_dry_run", "check_nccl"]

MODES = ("early", "grouped")
Item = tuple[Edge, str, int]  # (edge, direction, microbatch): what a SEND/RECV/WAIT triple moves

_K = ActionKind
_SENDS = (_K.SEND_F, _K.SEND_B)
_RECVS = (_K.RECV_F, _K.RECV_B)
_WAITS = (_K.WAIT_F, _K.WAIT_B)


@dataclass(frozen=True)
class PostingPlan:
    """Per mesh, what the runtime does besides each action: ``sends[mesh][i]`` the sends it posts at action i
    (a SEND posts itself; under grouped posting the sends of one compute's outputs — consecutive SENDs — wait
    for the last of them and go out together); ``posts[mesh][i]`` the receives it posts there, in the
    channel's order (in one group with that action's sends; at a WAIT before waiting); ``retire[mesh][i]``
    the sends known complete once action i ran."""

    mode: str
    shared: frozenset[frozenset[int]]
    sends: tuple[dict[int, tuple[Item, ...]], ...]
    posts: tuple[dict[int, tuple[Item, ...]], ...]
    retire: tuple[dict[int, tuple[Item, ...]], ...]

    def groups(self, mesh: int) -> int:
        """How many times `mesh` posts sends and receives in one group."""
        return sum(1 for i in self.sends[mesh] if self.posts[mesh].get(i))


def _peer_mesh(schedule: Schedule, a: Action) -> int:
    return schedule.mesh_of(a.peer)


def plan_posting(schedule: Schedule, mode: str = "early",
                 shared: Iterable[frozenset[int]] = ()) -> PostingPlan:
    """The posting plan of a lowered `schedule` (see the module's docstring); `shared`: the mesh pairs whose
    directions share a communicator. Grouped posting attaches each WAIT's receive to the group of the last
    send to the same peer before it (with the sends of the same compute, consecutive SENDs), or, without one,
    posts it at the WAIT."""
    if mode not in MODES:
        raise ValueError(f"posting mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not schedule.is_lowered:
        raise ScheduleError("plan_posting(): the schedule has no communication actions (lower it first)")
    shared = frozenset(frozenset(p) for p in shared)
    run_end = _run_ends(schedule, mode)
    sends = tuple({i: tuple(acts[j].key for j in sorted(js)) for i, js in _invert(run_end[s]).items()}
                  for s, acts in enumerate(schedule.actions))
    return PostingPlan(mode, shared, sends, _posts(schedule, mode, shared, _windows(schedule, mode, shared), run_end),
                       retire_points(schedule))


def _run_ends(schedule: Schedule, mode: str) -> list[dict[int, int]]:
    """Per mesh, SEND index -> where it is posted: itself, or under grouped posting the last of the consecutive
    SENDs it belongs to (one compute's outputs, sent in graph edge order)."""
    out = []
    for acts in schedule.actions:
        end: dict[int, int] = {}
        i = 0
        while i < len(acts):
            if acts[i].kind not in _SENDS:
                i += 1
                continue
            j = i
            while mode == "grouped" and j + 1 < len(acts) and acts[j + 1].kind in _SENDS:
                j += 1
            for k in range(i, j + 1):
                end[k] = j if mode == "grouped" else k
            i = j + 1
        out.append(end)
    return out


def _invert(m: dict[int, int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = defaultdict(list)
    for k, v in m.items():
        out[v].append(k)
    return out


def two_way_pairs(schedule: Schedule) -> frozenset[frozenset[int]]:
    """The mesh pairs that exchange tensors in both directions in `schedule`."""
    ways = {(schedule.mesh_of(a.stage), schedule.mesh_of(a.peer)) for acts in schedule.actions for a in acts
            if a.kind in _SENDS}
    return frozenset(frozenset(w) for w in ways if (w[1], w[0]) in ways)


def split_pairs(schedules: Iterable[Schedule], candidates: Iterable[frozenset[int]] | None = None
                ) -> frozenset[frozenset[int]]:
    """The mesh pairs whose two directions must keep separate communicators (each direction posting its
    receives early) so that grouped posting of the rest runs under NCCL's model: starting from every pair
    (or `candidates`) shared, the pairs of whatever stays stuck are split off until nothing does (with none
    shared, grouped posting is early posting, which the plain dry run already proved). Pure: a function of
    the programs alone, so every rank decides the same before any communicator exists."""
    schedules = list(schedules)
    pool = frozenset().union(*(two_way_pairs(s) for s in schedules)) if candidates is None else \
        frozenset(frozenset(p) for p in candidates)
    split: set[frozenset[int]] = set()
    while True:
        blocked: set[frozenset[int]] = set()
        for sched in schedules:
            plan = plan_posting(sched, "grouped", pool - split)
            blocked |= _run(sched, plan)[1] & (pool - split)
        if not blocked:
            return frozenset(split)
        split |= blocked


def _windows(schedule: Schedule, mode: str, shared: frozenset[frozenset[int]]) -> dict[tuple[int, int], list[int]]:
    """Per grouped WAIT (mesh, index): the last SEND to its peer before it (empty: none), whose group its receive
    joins. Between that send and the WAIT the mesh issues nothing else on the pair (the WAITs between join the
    same group), so the group holds, together, what would otherwise be issued one after the other."""
    out: dict[tuple[int, int], list[int]] = {}
    if mode != "grouped":
        return out
    for s, acts in enumerate(schedule.actions):
        last: dict[int, int] = {}  # peer mesh -> its last SEND so far
        for i, a in enumerate(acts):
            if a.kind not in _SENDS and a.kind not in _WAITS:
                continue
            b = _peer_mesh(schedule, a)
            if frozenset((s, b)) not in shared:
                continue
            if a.kind in _SENDS:
                last[b] = i
            else:
                out[(s, i)] = [last[b]] if b in last else []
    return out


def _posts(schedule: Schedule, mode: str, shared: frozenset[frozenset[int]], windows: dict[tuple[int, int], list[int]],
           run_end: list[dict[int, int]]) -> tuple[dict[int, tuple[Item, ...]], ...]:
    posts: list[dict[int, tuple[Item, ...]]] = []
    for s, acts in enumerate(schedule.actions):
        order: dict[int, list[Item]] = defaultdict(list)  # per peer mesh: receives in RECV (= channel) order
        for a in acts:
            if a.kind in _RECVS:
                order[_peer_mesh(schedule, a)].append(a.key)
        index = {b: {item: k for k, item in enumerate(items)} for b, items in order.items()}
        want: list[tuple[int, int, int]] = []  # (post at, peer, up to channel position)
        at: dict[int, list[Item]] = defaultdict(list)
        for i, a in enumerate(acts):
            if a.kind in _RECVS and not (mode == "grouped" and frozenset((s, _peer_mesh(schedule, a))) in shared):
                at[i].append(a.key)
            elif (s, i) in windows:
                b = _peer_mesh(schedule, a)
                w = windows[(s, i)]
                want.append((run_end[s][w[-1]] if w else i, b, index[b][a.key]))
        done = dict.fromkeys(order, 0)  # per peer: next receive of the channel not yet posted
        for i, b, k in sorted(want):
            while done[b] <= k:
                at[i].append(order[b][done[b]])
                done[b] += 1
        posts.append({i: tuple(v) for i, v in sorted(at.items()) if v})
    return tuple(posts)


def retire_points(schedule: Schedule) -> tuple[dict[int, tuple[Item, ...]], ...]:
    """Per mesh: action index -> the sends known complete once it ran (vector clocks over the programs run with
    non-blocking sends); a send missing here is retired at the end of the step."""
    M = schedule.num_meshes
    acts = schedule.actions
    vc = [[0] * M for _ in range(M)]
    clocks: list[list[tuple[int, ...]]] = [[] for _ in range(M)]
    sent: dict[Item, list[int]] = {}
    send_at: dict[Item, tuple[int, int]] = {}
    wait_at: dict[Item, tuple[int, int]] = {}
    pc = [0] * M
    progress = True
    while progress:
        progress = False
        for s in range(M):
            while pc[s] < len(acts[s]):
                a = acts[s][pc[s]]
                if a.kind in _WAITS:
                    if a.key not in sent:
                        break
                    vc[s] = [max(x, y) for x, y in zip(vc[s], sent[a.key])]
                    wait_at[a.key] = (s, pc[s])
                vc[s][s] = pc[s] + 1
                if a.kind in _SENDS:
                    sent[a.key] = list(vc[s])
                    send_at[a.key] = (s, pc[s])
                clocks[s].append(tuple(vc[s]))
                pc[s] += 1
                progress = True
    out: list[dict[int, list[Item]]] = [defaultdict(list) for _ in range(M)]
    for item, (s, i) in send_at.items():
        if item not in wait_at:
            continue
        b, w = wait_at[item]
        p = next((p for p in range(i + 1, len(clocks[s])) if clocks[s][p][b] > w), None)
        if p is not None:
            out[s][p].append(item)
    return tuple({i: tuple(v) for i, v in d.items()} for d in out)


def held_sends_peak(schedule: Schedule, plan: PostingPlan | None = None, direction: str = "F") -> list[int]:
    """Per mesh, the most sends of `direction` ('F': activations, whose data the runtime frees when it retires
    them) started and not yet retired at once — what retiring at the causal points costs in memory."""
    retire = (plan or plan_posting(schedule)).retire
    out = []
    for s, acts in enumerate(schedule.actions):
        held = peak = 0
        for i, a in enumerate(acts):
            held += a.kind in _SENDS and a.kind.direction == direction
            peak = max(peak, held)
            held -= sum(1 for item in retire[s].get(i, ()) if item[1] == direction)
        out.append(peak)
    return out


# ---- NCCL's model ---------------------------------------------------------------------------------
@dataclass(eq=False)
class _Op:
    kind: str  # "S" | "R"
    item: Item
    mesh: int
    index: int  # the action that issued it
    done: bool = False


def _text(a: Action) -> str:
    return a.text(True)


def nccl_dry_run(schedule: Schedule, plan: PostingPlan) -> list[tuple[int, int, Action, str]]:
    """Run every program under NCCL's model with `plan`'s posting; return the stuck programs as (mesh, step,
    action, why) — empty when every program finishes and every operation completes."""
    return _run(schedule, plan)[0]


def _run(schedule: Schedule, plan: PostingPlan) -> tuple[list[tuple[int, int, Action, str]], set[frozenset[int]]]:
    """`nccl_dry_run`, and the mesh pairs whose queues hold operations that never complete."""
    acts = schedule.actions
    M = schedule.num_meshes

    def queue_id(s: int, b: int, kind: str) -> tuple:
        return (s, frozenset((s, b))) if frozenset((s, b)) in plan.shared else (s, b, kind)

    queues: dict[tuple, deque[list[_Op]]] = defaultdict(deque)
    where: dict[tuple[str, Item], tuple[tuple, _Op]] = {}  # (kind, item) -> (queue, op)

    def issue(s: int, i: int, ops: list[tuple[str, Item, int]]) -> None:
        groups: dict[tuple, list[_Op]] = {}
        for kind, item, b in ops:
            op = _Op(kind, item, s, i)
            q = queue_id(s, b, kind)
            groups.setdefault(q, []).append(op)
            where[(kind, item)] = (q, op)
        for q, g in groups.items():
            queues[q].append(g)

    def running(kind: str, item: Item) -> bool:
        got = where.get((kind, item))
        return got is not None and bool(queues[got[0]]) and any(o is got[1] for o in queues[got[0]][0])

    peer_of: dict[Item, int] = {}
    send_peer: dict[Item, int] = {}
    for s in range(M):
        for a in acts[s]:
            if a.kind in _RECVS:
                peer_of[a.key] = _peer_mesh(schedule, a)
            elif a.kind in _SENDS:
                send_peer[a.key] = _peer_mesh(schedule, a)
    pc = [0] * M
    issued = [-1] * M  # the last action whose operations were issued
    progress = True
    while progress:
        progress = False
        for s in range(M):  # programs: issue, and block only at a WAIT whose receive has not completed
            while pc[s] < len(acts[s]):
                i, a = pc[s], acts[s][pc[s]]
                if issued[s] < i:
                    ops = [("S", x, send_peer[x]) for x in plan.sends[s].get(i, ())]
                    ops += [("R", y, peer_of[y]) for y in plan.posts[s].get(i, ())]
                    if ops:
                        issue(s, i, ops)
                    issued[s] = i
                if a.kind in _WAITS:
                    got = where.get(("R", a.key))
                    if got is None or not got[1].done:
                        break
                pc[s] += 1
                progress = True
        for q in list(queues):  # communicators: an operation completes when it and its match both run
            while queues[q]:
                head = queues[q][0]
                for op in head:
                    other = "R" if op.kind == "S" else "S"
                    if not op.done and running(other, op.item):
                        op.done = True
                        where[(other, op.item)][1].done = True
                        progress = True
                if not all(op.done for op in head):
                    break
                queues[q].popleft()
    stuck = []
    for s in range(M):
        if pc[s] < len(acts[s]):
            a = acts[s][pc[s]]
            stuck.append((s, pc[s], a, _why(schedule, a, where, queues)))
    if not stuck:
        for q, groups in queues.items():
            if groups:
                op = next(o for o in groups[0] if not o.done)
                a = acts[op.mesh][op.index]
                stuck.append((op.mesh, op.index, a, f"its {'send' if op.kind == 'S' else 'receive'} never completes"))
                break
    def pair(q: tuple) -> frozenset[int]:
        return frozenset((q[0], q[1])) if len(q) == 3 else q[1]

    # where the hang starts: a shared communicator whose head holds an unfinished send while a receive the
    # program waits for sits behind it (the crossing); else every communicator left with work
    waited = {(s, a.key) for s, i, a, _ in stuck if a.kind in _WAITS}
    crossing = {pair(q) for q, groups in queues.items() if len(q) == 2 and groups
                and any(not o.done and o.kind == "S" for o in groups[0])
                and any(o.kind == "R" and (o.mesh, o.item) in waited for g in list(groups)[1:] for o in g)}
    blocked = crossing or {pair(q) for q, groups in queues.items() if groups}
    return stuck, blocked


def _describe(op: _Op, schedule: Schedule) -> str:
    e, d, mb = op.item
    what = f"{'send' if op.kind == 'S' else 'receive'} of {'activation' if d == 'F' else 'gradient'} {mb} on edge {e}"
    return f"the {what} (issued at mesh {op.mesh} action {op.index} {_text(schedule.actions[op.mesh][op.index])!r})"


def _why(schedule: Schedule, a: Action, where: dict, queues: dict) -> str:
    """What a stuck WAIT waits for under NCCL's model: the operation at the head of its receive's queue, and
    what that one waits for."""
    got = where.get(("R", a.key))
    if got is None:
        return "its receive was never posted"
    q, op = got
    head_group = queues[q][0] if queues[q] else []
    if any(o is op for o in head_group):  # running: it waits for its sender
        match = where.get(("S", op.item))
        if match is None:
            return f"{_describe(op, schedule)} waits for its send, never issued"
        mq, mop = match
        blocker = next((o for o in queues[mq][0] if not o.done), mop) if queues[mq] else mop
        return (f"{_describe(op, schedule)} waits for {_describe(mop, schedule)}, which NCCL runs only after "
                f"{_describe(blocker, schedule)}")
    head = next(o for o in head_group if not o.done)
    return (f"{_describe(op, schedule)} is queued behind {_describe(head, schedule)} on the same communicator "
            "(NCCL runs a communicator's operations in issue order)")


def check_nccl(schedule: Schedule, plan: PostingPlan) -> None:
    """Raise `ScheduleError` naming the stuck action unless `schedule` runs to the end under NCCL's model with
    `plan`'s posting."""
    stuck = nccl_dry_run(schedule, plan)
    if not stuck:
        return
    s, i, a, why = stuck[0]
    lines = [f"  mesh {m} action {k} {_text(x)!r}: {w}" for m, k, x, w in stuck]
    raise ScheduleError(f"deadlock under NCCL's ordering ({plan.mode} receive posting):\n" + "\n".join(lines),
                        mesh=s, index=i, action=_text(a), why=f"deadlock under NCCL's ordering ({plan.mode} receive "
                        f"posting): {why}")
