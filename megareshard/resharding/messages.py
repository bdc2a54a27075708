"""The messages of a resharding plan, per unit task and rank — pure Python, no processes.

``build_messages`` turns one unit task under a strategy into point-to-point messages (flat
element ranges between ranks, chunked for the broadcast chain); ``nic_side_chains`` lists,
for every host NIC direction, the tasks that use it in plan order with the ranks that post
their wire messages — what the executor's plan-order mode serialises. Kept apart from
``executor.py`` so the message layout is testable without torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .strategies import get_strategy
from .wire import Msg as _Msg, by_host

ORDERS = ("plan", "concurrent")
DEFAULT_ORDER = "concurrent"
"""The default execution order, chosen from the emulated-cluster runs (docs/benchmarks.md,
"Cross-mesh resharding", 5 hosts x 2 ranks, 1 Gbit/s): with the default scheduler (auto)
the two orders are equal within noise (plan/concurrent time, geometric mean over the nine
paper cases: 0.98-1.01 per strategy), but under a schedule whose order is poor (naive,
loadbalance on cases 3, 4, 6, 9) "plan" executes that order faithfully and is up to 2x
slower, while "concurrent" lets TCP share each NIC and lands within noise of the best
schedule. "concurrent" also needs no hand-over threads or tokens. Choose "plan" to study
schedules, as the paper does (`NetworkModel.predict(plan, order)` models both orders)."""
SEND_SIDE, RECV_SIDE = 0, 1  # a host NIC's two directions (as network.SEND / network.RECV)


@dataclass
class _TaskProgram:
    """Everything every rank knows about one unit task, in global posting order."""

    pos: int  # position in execution order
    index: int  # the plan's task index
    region: tuple[slice, ...]  # slice of the global tensor
    shape: tuple[int, ...]
    numel: int
    sender: int
    local: tuple[int, ...]  # receivers that already hold the slice: local copy
    msgs: list[_Msg]
    group_ranks: tuple[int, ...] = ()  # the task's communicator: sender first, then the remote receivers
    chunks: int = 1  # broadcast chunk count K of this task


@dataclass
class _RankTask:
    """This rank's part in one task (compiled once at construction)."""

    prog: _TaskProgram
    src_view: tuple[slice, ...] | None  # the slice inside this rank's source shard
    dst_view: tuple[slice, ...] | None  # the slice inside this rank's destination shard
    copy_local: bool  # receiver holding the slice itself
    sends: list[_Msg] = field(default_factory=list)  # direct sends from this rank's source data
    recvs: list[_Msg] = field(default_factory=list)
    forwards: list[_Msg] = field(default_factory=list)
    key: Any = None  # the communicator this rank uses for the task: (sender, remote receivers)
    in_nccl_group: bool = False  # NCCL broadcast participant (one collective, no messages)
    # plan order: this rank's wire operations and its place in each NIC side's chain
    wire_recvs: list[_Msg] = field(default_factory=list)
    wire_sends: list[_Msg] = field(default_factory=list)  # direct sends over the NIC
    wire_fwds: list[_Msg] = field(default_factory=list)  # forwards over the NIC (broadcast hop)
    intra_fwds: list[_Msg] = field(default_factory=list)
    # side -> (previous task's position if this rank used the side for it, other ranks to get a token from)
    gate: dict[int, tuple[int | None, tuple[int, ...]]] = field(default_factory=dict)
    # side -> (next task's position on the side or None, other ranks to send a token to)
    signal: dict[int, tuple[int | None, tuple[int, ...]]] = field(default_factory=dict)


def _relative(region: Sequence[slice], base: Sequence[slice]) -> tuple[slice, ...]:
    return tuple(slice(r.start - b.start, r.stop - b.start) for r, b in zip(region, base))


def _contains(outer: Sequence[slice], inner: Sequence[slice]) -> bool:
    return all(o.start <= i.start and i.stop <= o.stop for o, i in zip(outer, inner))


def _shape(region: Sequence[slice]) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in region)


def rotate_receivers(remote: Sequence[int], host_of: dict[int, int], turns: dict[int, int]) -> list[int]:
    """`remote` (sorted) with each host's receivers rotated by the number of earlier tasks that reached that host
    (`turns`, updated): a strategy sends a host's share to its first receiver listed (the broadcast chain's head,
    which fans out to the others), so successive tasks enter a host through successive devices instead of all
    through its first one. Pure and the same on every rank: call it in execution order."""
    out: list[int] = []
    for h, rs in by_host(remote, host_of).items():
        k = turns.get(h, 0) % len(rs)
        out += rs[k:] + rs[:k]
        turns[h] = turns.get(h, 0) + 1
    return out


def build_messages(strategy: str, numel: int, sender: int, remote: Sequence[int],
                   host_of: dict[int, int], chunks: int) -> list[_Msg]:
    """The messages of one unit task in global posting order (pure: unit-testable), as the registered
    `strategy` lays them out (`strategies/`).

    `remote` are the receivers that need the data over the wire (sorted). Receivers on
    the sender's host are served by the sender itself (intra-host), other hosts as the
    strategy says.
    """
    if not remote:
        return []
    return get_strategy(strategy).messages(numel, sender, remote, host_of, chunks)


def comm_key(p: _TaskProgram, plan_order: bool = False) -> tuple | None:
    """The communicator a task runs on (None: no remote receiver), the same on every rank (pure).

    ``(participants, forwarders)`` — sorted rank tuples; tasks of both directions of a pipeline edge between
    two one-rank ends share ``((a, b), ())``. A task sent as one collective (NCCL broadcast: no messages)
    gets ``("bcast", sender, participants)``, and a plan-order run ``("plan", participants, forwarders)``
    (see `streams.py`)."""
    if not p.group_ranks:
        return None
    parts = tuple(sorted(p.group_ranks))
    if not p.msgs:
        return ("bcast", p.sender, parts)
    fwd = tuple(sorted({m.src for m in p.msgs if m.forward}))
    return ("plan", parts, fwd) if plan_order else (parts, fwd)


def nic_side_chains(programs: Sequence[_TaskProgram], host_of: dict[int, int]
                    ) -> dict[tuple[int, int], list[tuple[int, frozenset[int]]]]:
    """Per host NIC side `(host, SEND_SIDE | RECV_SIDE)`: the tasks whose wire messages use
    it, as `(position, ranks of that host posting them)`, in execution order (pure).

    A wire message joins two hosts; it uses its source host's send side and its
    destination host's receive side. Intra-host messages use no NIC.
    """
    chains: dict[tuple[int, int], list[tuple[int, frozenset[int]]]] = {}
    for p in sorted(programs, key=lambda q: q.pos):
        users: dict[tuple[int, int], set[int]] = {}
        for m in p.msgs:
            hs, hd = host_of[m.src], host_of[m.dst]
            if hs != hd:
                users.setdefault((hs, SEND_SIDE), set()).add(m.src)
                users.setdefault((hd, RECV_SIDE), set()).add(m.dst)
        for side, us in users.items():
            chains.setdefault(side, []).append((p.pos, frozenset(us)))
    return dict(sorted(chains.items()))
