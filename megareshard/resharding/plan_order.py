"""Plan order (gloo): a `Resharder`'s runs with each host NIC side serving one task at a time, in plan order.

The paper's model (§3.2) and `NetworkModel.predict`'s, described with the execution orders in ``executor.py``'s
docstring: a task's wire operations on a NIC side are posted only after every rank that used that side for the
previous task of its chain (`programs.nic_gates`) has completed its operations there; hand-overs inside a rank
are events, between two ranks of a host 1-byte tokens on the host's token communicator. This module holds the
stream items that run it, as a base class of `Resharder` (they read its compiled state: the rank tasks, the
token lists, the token communicator).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.nccl_check import set_label
from .handle import RunState, await_entry
from .messages import RECV_SIDE, SEND_SIDE, _RankTask

__all__ = ["PlanOrderItems"]


class PlanOrderItems:
    """The plan-order stream items of a `Resharder` (its base class: the state they read is the Resharder's)."""


    def _tokens(self, run: RunState, n: int) -> None:
        """The token communicator's thread: post every token receive of the run, then send each token
        as soon as its (task, side) is done here, in the receivers' (task, side) order."""
        g = self._token_group
        try:
            for pos, side, src in self._token_recvs:
                set_label(f"{self.name}#{n}/token/t{pos}/s{side}")
                entry = [dist.irecv(self._token_buf(), src=self._global(src), group=g), False]
                run.token_works.setdefault((pos, side), []).append(entry)
            run.tokens_posted.set()
            sent = []
            for next_pos, side, pos, dst in self._token_sends:
                while not run.side_done[(pos, side)].wait(0.05):
                    if run.failed.is_set():
                        raise RuntimeError("another stream of this run failed")
                set_label(f"{self.name}#{n}/token/t{next_pos}/s{side}")
                sent.append(dist.isend(self._one_byte, dst=self._global(dst), group=g))
            for w in sent:
                w.wait()
        except BaseException:
            run.failed.set()
            run.tokens_posted.set()
            raise
        finally:
            set_label(None)

    def _token_buf(self) -> torch.Tensor:
        return torch.empty(1, dtype=torch.uint8, device=self._device)

    def _gate(self, rt: _RankTask, side: int, run: RunState) -> None:
        """Wait until the previous task on this host's NIC `side` is done on every rank that used it."""
        if side not in rt.gate:
            return
        prev_pos, others = rt.gate[side]
        if prev_pos is not None:
            while not run.side_done[(prev_pos, side)].wait(0.05):
                if run.failed.is_set():
                    raise RuntimeError("another stream of this run failed")
        if others:
            run.tokens_posted.wait()
            for entry in run.token_works.get((rt.prog.pos, side), []):
                await_entry(entry)
        if run.failed.is_set():
            raise RuntimeError("another stream of this run failed")

    def _done(self, rt: _RankTask, side: int, run: RunState, t_post: float) -> None:
        ev = run.side_done.get((rt.prog.pos, side))
        if ev is not None:
            ev.set()
        if self.trace:
            run.trace.append({"pos": rt.prog.pos, "task": rt.prog.index, "rank": self.rank,
                              "host": self._host_of[self.rank], "side": "send" if side == SEND_SIDE else "recv",
                              "t_post": t_post, "t_done": time.monotonic()})

    def _item_plan(self, group: Any, rts: list[_RankTask], flats: dict, run: RunState, n: int) -> None:
        try:
            for rt in rts:
                self._task_plan(group, rt, flats, run, n)
        except BaseException:
            run.failed.set()
            for ev in run.side_done.values():  # never leave this rank's other streams waiting on this one
                ev.set()
            raise
        finally:
            set_label(None)

    def _task_plan(self, group: Any, rt: _RankTask, flats: dict, run: RunState, n: int) -> None:
        """One task: intra-host receives at once; wire receives after the receive gate; sends after the
        send gate; forwards as their data arrives; each NIC side released when this rank is done with it."""
        me, host = self.rank, self._host_of
        p = rt.prog
        recv_flat, send_flat = flats[p.pos]
        wire = {id(m) for m in rt.wire_recvs}
        recv_of: dict[tuple[int, int], list[Any]] = {}
        for j, m in enumerate(p.msgs):  # intra-host receives: no NIC
            if m.dst == me and id(m) not in wire:
                recv_of[(m.start, m.stop)] = self._recv(group, run, n, p, j, m, recv_flat)
        t_recv = 0.0
        if rt.wire_recvs:
            self._gate(rt, RECV_SIDE, run)
            t_recv = time.monotonic()
            for j, m in enumerate(p.msgs):
                if m.dst == me and id(m) in wire:
                    recv_of[(m.start, m.stop)] = self._recv(group, run, n, p, j, m, recv_flat)
        t_send = 0.0
        wire_sent: list[list[Any]] = []
        if rt.wire_sends or rt.wire_fwds:
            self._gate(rt, SEND_SIDE, run)
            t_send = time.monotonic()
        wire_left = len(rt.wire_recvs)
        # sends and forwards in global message order; a forward's data came in an earlier message
        for j, m in enumerate(p.msgs):
            if m.dst == me and id(m) in wire:
                await_entry(recv_of[(m.start, m.stop)])
                wire_left -= 1
                if wire_left == 0:
                    self._done(rt, RECV_SIDE, run, t_recv)
            if m.src != me:
                continue
            if m.forward:
                await_entry(recv_of[(m.start, m.stop)])
                entry = self._send(group, run, n, p, j, m, recv_flat)
            else:
                entry = self._send(group, run, n, p, j, m, send_flat)
            if host[m.src] != host[m.dst]:
                wire_sent.append(entry)
        if rt.wire_sends or rt.wire_fwds:
            for entry in wire_sent:
                await_entry(entry)
            self._done(rt, SEND_SIDE, run, t_send)
        elif (p.pos, SEND_SIDE) in run.side_done:
            run.side_done[(p.pos, SEND_SIDE)].set()
