"""What each rank runs of a scheduled resharding plan, compiled once when a `Resharder` is built — pure Python.

``task_programs``: every unit task in the agreed order ([(task index, sending rank)], `agree.py`), its remote
receivers rotated over each host's devices and its messages laid out by the strategy (none for an NCCL
broadcast); ``rank_tasks``: this rank's part in each (what it sends, receives, forwards, copies locally, and
over which NIC); ``communicator_items``: this rank's tasks grouped by communicator and whether a stream thread
issues them; ``nic_gates``: for plan order, this rank's place in the chains of its host's two NIC sides and the
tokens it receives and sends. Kept apart from ``executor.py`` (which runs them) so the compilation reads alone.
"""

from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING, Callable, Sequence

from .messages import (RECV_SIDE, SEND_SIDE, _contains, _RankTask, _relative, _shape, _TaskProgram, build_messages,
                       nic_side_chains, rotate_receivers)
from .streams import GroupKey

if TYPE_CHECKING:  # pragma: no cover
    from .plan import ReshardingPlan

__all__ = ["task_programs", "rank_tasks", "communicator_items", "nic_gates"]


def task_programs(plan: "ReshardingPlan", task_order: Sequence[tuple[int, int | None]], host_of: dict[int, int],
                  strategy: str, nccl_broadcast: bool) -> list[_TaskProgram]:
    """Every task of ``plan`` as a program, in the agreed ``task_order``; ``nccl_broadcast``: tasks go as one
    NCCL broadcast each (no messages)."""
    by_index = {t.index: t for t in plan.tasks}
    programs: list[_TaskProgram] = []
    turns: dict[int, int] = {}  # tasks that reached each host so far: where the next one enters it
    for pos, (index, sender) in enumerate(task_order):
        task = by_index[index]
        if sender is None or sender not in task.senders:
            raise ValueError(f"task {index}: chosen sender {sender} does not hold the slice "
                             f"(holders {list(task.senders)}); was the plan scheduled?")
        region = tuple(task.slice)
        held = set(task.senders)
        local = tuple(r for r in task.receivers if r in held)
        remote = rotate_receivers(sorted(r for r in task.receivers if r not in held), host_of, turns)
        numel = prod(_shape(region))
        k = int(task.chunks)  # chosen by the planner: plan and executor cannot disagree
        msgs = [] if nccl_broadcast else build_messages(strategy, numel, sender, remote, host_of, k)
        members = (sender, *remote) if remote else ()
        programs.append(_TaskProgram(pos, index, region, _shape(region), numel, sender, local, msgs,
                                     members, chunks=k))
    return programs


def rank_tasks(programs: Sequence[_TaskProgram], rank: int, src_region: tuple[slice, ...] | None,
               dst_region: tuple[slice, ...] | None, host_of: dict[int, int],
               key_of: Callable[[_TaskProgram], GroupKey | None]) -> list[_RankTask]:
    """This rank's part in every task it takes part in, in execution order (``key_of``: a task's communicator)."""
    mine: list[_RankTask] = []
    for p in programs:
        rt = _RankTask(
            prog=p,
            src_view=(_relative(p.region, src_region)
                      if src_region is not None and _contains(src_region, p.region) else None),
            dst_view=(_relative(p.region, dst_region)
                      if dst_region is not None and _contains(dst_region, p.region) else None),
            copy_local=rank in p.local,
        )
        for m in p.msgs:
            wire = host_of[m.src] != host_of[m.dst]
            if m.dst == rank:
                rt.recvs.append(m)
                if wire:
                    rt.wire_recvs.append(m)
            if m.src == rank:
                (rt.forwards if m.forward else rt.sends).append(m)
                if m.forward:
                    (rt.wire_fwds if wire else rt.intra_fwds).append(m)
                elif wire:
                    rt.wire_sends.append(m)
        rt.in_nccl_group = bool(p.group_ranks) and rank in p.group_ranks and not p.msgs
        if p.group_ranks and rank in p.group_ranks:
            rt.key = key_of(p)
        if rt.sends and rt.src_view is None:
            raise AssertionError(f"rank {rank} sends task {p.index} but its shard does not hold it")
        if (rt.recvs or rt.copy_local or rt.in_nccl_group) and rank != p.sender and rt.dst_view is None:
            raise AssertionError(f"rank {rank} receives task {p.index} outside its destination shard")
        if rt.copy_local or rt.sends or rt.recvs or rt.forwards or rt.in_nccl_group:
            mine.append(rt)
    return mine


def communicator_items(mine: Sequence[_RankTask], plan_order: bool
                       ) -> tuple[list[tuple[GroupKey, list[_RankTask]]], dict[GroupKey, bool]]:
    """This rank's items: its tasks grouped by communicator, in order of first appearance; issued inline unless
    this rank forwards on the communicator (or runs plan order): then by its stream thread (``True``)."""
    items: list[tuple[GroupKey, list[_RankTask]]] = []
    index: dict[GroupKey, int] = {}
    for rt in mine:
        if rt.key is None:
            continue
        if rt.key not in index:
            index[rt.key] = len(items)
            items.append((rt.key, []))
        items[index[rt.key]][1].append(rt)
    # the key names the forwarders, so a rank forwarding in one task on it forwards in every such task
    threaded = {key: plan_order or any(rt.forwards for rt in rts) for key, rts in items}
    return items, threaded


def nic_gates(programs: Sequence[_TaskProgram], mine: Sequence[_RankTask], rank: int, host_of: dict[int, int]
              ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int, int]]]:
    """Plan order: where this rank sits in the chains of its host's two NIC sides. Sets the rank tasks' ``gate``
    and ``signal``; returns the token receives and sends, each sorted (the receivers' order)."""
    my_host = host_of.get(rank)
    chains = nic_side_chains(programs, host_of) if my_host is not None else {}
    by_pos = {rt.prog.pos: rt for rt in mine}
    token_recvs: list[tuple[int, int, int]] = []  # (pos, side, from rank), receivers' order
    token_sends: list[tuple[int, int, int, int]] = []  # (next pos, side, my pos, to rank), same order
    for side in (SEND_SIDE, RECV_SIDE):
        chain = chains.get((my_host, side), [])
        for i, (pos, users) in enumerate(chain):
            if rank not in users:
                continue
            rt = by_pos[pos]
            if i > 0:
                prev_pos, prev_users = chain[i - 1]
                others = tuple(sorted(prev_users - {rank}))
                rt.gate[side] = (prev_pos if rank in prev_users else None, others)
                token_recvs += [(pos, side, o) for o in others]
            if i + 1 < len(chain):
                next_pos, next_users = chain[i + 1]
                others = tuple(sorted(next_users - {rank}))
                rt.signal[side] = (next_pos, others)
                token_sends += [(next_pos, side, pos, o) for o in others]
    token_recvs.sort()
    token_sends.sort()
    return token_recvs, token_sends
