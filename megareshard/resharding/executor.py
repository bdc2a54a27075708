"""Execute a cross-mesh resharding plan with torch.distributed (DESIGN.md §3.5).

A `Resharder` is built once per (plan, dtype) — collectively, on every rank of the
default process group — and then run every microbatch:

    resharder = Resharder(plan, torch.float32, chunks=8)
    out = resharder.run(local_src)          # or: h = resharder.start(local_src); ...; h.wait()

Why it is built this way:

* **One global order.** Every message of every unit task gets a fixed position: plan task
  order, then the strategy's message order (chunk order for broadcast). Each rank posts
  the messages it takes part in in that order, with the task's position as the tag, so
  gloo's (peer pair, tag) FIFO matching pairs them up and nothing can wait on a message
  that is posted later. Nothing — groups, buffers, message lists — is created lazily or
  in rank-dependent order: construction makes all of it (the known deadlock of lazily
  created communicators in Megatron and torch pipelining cannot happen).
* **Asynchronous.** Direct messages (the holder of the data sending it, receivers
  receiving) are posted as async `isend`/`irecv` in `start()`. A rank that *forwards*
  data it receives (broadcast chain hop, intra-host fan-out, allgather exchange) must
  wait for each chunk before passing it on; progress threads do that, one per task this
  rank forwards for (a single thread in global order would hold back a task whose
  chunks arrive while an earlier task is still arriving), so `start()` returns at once
  and the pipeline keeps flowing while the caller computes. A task's thread of one run
  first joins the same task's thread of the previous run, which keeps the posting order
  of every (pair, tag) FIFO across runs of one Resharder.
* **Strategies** (paper §3.1): `sendrecv` (sender → every receiver), `allgather` (sender
  → 1/B of the slice to each of a host's B receivers, which then exchange pieces
  inside the host), `broadcast` (the slice in `chunks` pieces along the chain sender →
  first receiver of each other host in ascending host order, each hop forwarding chunk k
  as soon as it has it, every hop also fanning out to the other receivers on its host;
  on NCCL a `dist.broadcast` on a cached per-task sub-communicator instead, which NCCL
  pipelines itself), `signal` (one byte per receiver per task: the end-to-end upper
  bound; **the returned tensor then has the right shape but undefined values**).
* A destination rank that holds a slice in its own source shard (overlapping meshes)
  copies it locally; receivers on the sender's host still get it by a (loopback) message.

**Execution order** (`order=`):

* `"concurrent"`: every rank posts the messages of *all* tasks at once (above). The plan's
  order is then irrelevant: TCP fair-shares each NIC among the flows that cross it, no
  NIC idles while another task could use it, and only the plan's *sender choice* matters.
* `"plan"`: the paper's model (§3.2) and `NetworkModel.predict`'s — one NIC side (send or
  receive) of a host serves one task at a time, in plan order; tasks on disjoint NIC
  sides (a round of `plan.rounds`) run together. A message is a *wire* message when its
  two ranks sit on different hosts; it uses the send side of its source host and the
  receive side of its destination host. Per NIC side, the tasks whose wire messages use
  it form a chain in plan order; a task's wire operations on a side are posted only after
  every rank that used that side for the previous task of the chain has completed its
  operations there. No global barrier and no cross-host control message is needed:
  gloo's unbound send is a rendezvous (data flows only after the receiver posts its
  receive), so holding back the *sender's* isend enforces the send side and holding back
  the *receiver's* irecv enforces the receive side. Completion is known locally (a
  progress thread waits on the works) and passed on inside the host: a `threading.Event`
  when the next user of the side is the same rank, else a 1-byte loopback token message
  to it (tag `TOKEN_TAG_BASE + 2·(tag_base + pos) + side`, so tokens never share a (pair,
  tag) with data). Per task a rank runs up to two progress threads: `rx` (receive gate,
  post wire receives, wait for each piece and pass it to the intra-host fan-out, signal
  the receive side) and `tx` (send gate, post direct sends, forward chunks as the `rx`
  thread marks them arrived, wait, signal the send side), so a broadcast relay's receive
  side is released as soon as its data is in, whatever its send side waits for. Every
  wait points to an earlier task on the same side, or to the same task's upstream data,
  so the waits form a DAG over (task, side) in the one global order: no deadlock.
  `start()` still returns at once. Costs: ≤ 2 threads per (rank, task with wire
  traffic) per run, one loopback token per side hand-over between two ranks of a host,
  and a thread wake-up per hand-over (measured: a `signal` run, 1 byte per task, takes a
  median 7.7 ms under "plan" against 5.2 ms under "concurrent"); a send side is released when the
  sender's isend completes, i.e. when the last bytes entered the kernel's socket buffer
  (gloo sets SO_SNDBUF up to the message size, capped by net.core.wmem_max), so the next
  task on a send side may start up to one socket buffer (≤ 8 MB here, ~65 ms at 1 Gbit/s)
  before the previous one has left the NIC — the receive side is exact. On NCCL (a
  broadcast per task on its own communicator) the order is not enforced: "plan" acts as
  "concurrent".

Default: `"concurrent"` — see `DEFAULT_ORDER` for the measurement behind the choice.
With `trace=True` every `plan`-mode run records, per (task, NIC side) this rank used,
when its wire operations were posted and when they completed (`handle.trace`).

Concurrent Resharders whose messages share rank pairs must use disjoint tag ranges
(`tag_base` .. `tag_base + len(plan.tasks) - 1`, below 2**21), since gloo matches by
(pair, tag); a pair's j-th message of a task adds j * 2**21 to the task's tag. Don't modify `local_src` before `wait()` (contiguous slices of it are sent
without a copy).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .messages import (DEFAULT_ORDER, MAX_PAIR_MESSAGES, ORDERS, PAIR_SEQ_STRIDE, RECV_SIDE, SEND_SIDE, STRATEGIES,
                       TOKEN_TAG_BASE, _contains, _Msg,
                       _RankTask, _relative, _shape, _TaskProgram, build_messages, nic_side_chains)
from .spec import local_slices

if TYPE_CHECKING:  # pragma: no cover
    from .plan import ReshardingPlan

@dataclass
class _PlanRun:
    """State shared by one plan-order run's progress threads on one rank."""

    works: list[Any]  # waited by ReshardHandle.wait() unless in `waited`
    waited: dict[int, Any] = field(default_factory=dict)  # id -> the work itself (see ReshardHandle)
    errors: list[BaseException] = field(default_factory=list)
    side_done: dict[tuple[int, int], threading.Event] = field(default_factory=dict)  # (pos, side)
    arrived: dict[tuple[int, int, int], threading.Event] = field(default_factory=dict)  # (pos, start, stop)
    trace: list[dict[str, Any]] = field(default_factory=list)



class ReshardHandle:
    """An in-flight resharding run; `wait()` returns the destination shard (or None)."""

    def __init__(self, owner: "Resharder", out: torch.Tensor | None, works: list[Any],
                 copies: list[tuple[torch.Tensor, torch.Tensor]], threads: list[threading.Thread],
                 errors: list[BaseException], keep: list[Any], bufs: dict[int, torch.Tensor] | None,
                 waited: dict[int, Any]) -> None:
        self._owner = owner
        # Works a progress thread already waited on, by id, *holding the work*: a bare id set
        # let a freed work's id be reused by a later send, whose wait() was then skipped; the
        # send's buffer was freed before gloo sent it and the peer waited forever.
        self._waited = waited
        self._out = out
        self._works = works
        self._copies = copies  # (destination view, flat receive buffer) after the data is in
        self._threads = threads
        self._errors = errors
        self._keep = keep  # send payloads must live until the sends complete
        self._bufs = bufs
        self._done = False
        self.trace: list[dict[str, Any]] = []  # plan order with trace=True: filled by the progress threads

    def wait(self) -> torch.Tensor | None:
        if self._done:
            return self._out
        for t in self._threads:
            t.join()
        if self._errors:
            raise RuntimeError(f"rank {self._owner.rank}: resharding progress thread failed") from self._errors[0]
        for w in self._works:
            if id(w) not in self._waited:  # gloo counts completions: a second wait() blocks forever
                w.wait()
        for view, buf in self._copies:
            view.copy_(buf.view(view.shape))
        self._done = True
        self._keep.clear()
        if self._bufs is not None:
            self._owner._release(self._bufs)
            self._bufs = None
        return self._out


class Resharder:
    """Runs one `ReshardingPlan` for tensors of one dtype; construction is collective.

    Every rank of the default process group must construct it, in the same order as its
    other collectives, even ranks in neither mesh. Mesh ranks are ranks of `group`
    (default: the world).
    """

    def __init__(self, plan: "ReshardingPlan", dtype: torch.dtype, *, chunks: int = 4,
                 group: Any = None, tag_base: int = 0, sync_plan: bool = True,
                 order: str | None = None, trace: bool = False) -> None:
        order = DEFAULT_ORDER if order is None else order
        if order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        if plan.strategy not in STRATEGIES:
            raise ValueError(f"strategy {plan.strategy!r} cannot be executed; allowed: {', '.join(STRATEGIES)}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        if int(chunks) != chunks or chunks < 1:
            raise ValueError(f"chunks must be an integer >= 1, got {chunks!r}")
        if not dist.is_initialized():
            raise RuntimeError("Resharder needs an initialised torch.distributed process group")
        self.plan = plan
        self.dtype = dtype
        self.chunks = int(chunks)
        self.strategy = plan.strategy
        self.group = group
        self.tag_base = int(tag_base)
        if not 0 <= self.tag_base or self.tag_base + len(plan.tasks) > PAIR_SEQ_STRIDE:
            raise ValueError(f"tag_base {tag_base} out of range: tags tag_base..tag_base+{len(plan.tasks) - 1} "
                             f"must lie in [0, {PAIR_SEQ_STRIDE}) (each message adds a pair sequence above that)")
        self.order = order
        self.trace = bool(trace)
        self.rank = dist.get_rank(group) if group is not None else dist.get_rank()
        world = dist.get_world_size(group) if group is not None else dist.get_world_size()
        self.shape = tuple(int(s) for s in plan.shape)
        all_ranks = set(plan.src_mesh.flat_ranks) | set(plan.dst_mesh.flat_ranks)
        if max(all_ranks) >= world:
            raise ValueError(f"the meshes use rank {max(all_ranks)} but the process group has {world} ranks")
        self._nccl = dist.get_backend(group) == "nccl"
        order = self._agree_on_order(plan) if sync_plan else [(t.index, t.sender) for t in plan.tasks]

        self._src_region = local_slices(self.shape, plan.src_mesh, plan.src_spec, self.rank)
        self._dst_region = local_slices(self.shape, plan.dst_mesh, plan.dst_spec, self.rank)
        self.src_shape = None if self._src_region is None else _shape(self._src_region)
        self.dst_shape = None if self._dst_region is None else _shape(self._dst_region)

        by_index = {t.index: t for t in plan.tasks}
        host_of = {r: plan.dst_mesh.host_of(r) for r in plan.dst_mesh.flat_ranks}
        host_of.update({r: plan.src_mesh.host_of(r) for r in plan.src_mesh.flat_ranks})
        self.programs: list[_TaskProgram] = []
        for pos, (index, sender) in enumerate(order):
            task = by_index[index]
            if sender is None or sender not in task.senders:
                raise ValueError(f"task {index}: chosen sender {sender} does not hold the slice "
                                 f"(holders {list(task.senders)}); was the plan scheduled?")
            region = tuple(task.slice)
            held = set(task.senders)
            local = tuple(r for r in task.receivers if r in held)
            remote = [r for r in task.receivers if r not in held]
            numel = prod(_shape(region))
            msgs = build_messages(self.strategy, numel, sender, remote, host_of, self.chunks)
            grp = (sender, *remote) if self._nccl and self.strategy == "broadcast" and remote else ()
            self.programs.append(_TaskProgram(pos, index, region, _shape(region), numel, sender, local, msgs, grp))

        # One tag per message: the j-th message of a task between the same (src, dst) pair gets
        # tag_base + pos + j * PAIR_SEQ_STRIDE. Both ends derive j from the global message order,
        # so matching never depends on which thread posts first (plan order posts a pair's
        # messages from several threads; one shared tag per task let gloo's FIFO cross them).
        self._tags: dict[tuple[int, _Msg], int] = {}
        for p in self.programs:
            seq: dict[tuple[int, int], int] = {}
            for m in p.msgs:
                j = seq.get((m.src, m.dst), 0)
                seq[(m.src, m.dst)] = j + 1
                if j >= MAX_PAIR_MESSAGES:
                    raise ValueError(f"task {p.index}: {j + 1} messages between ranks {m.src} and {m.dst} "
                                     f"exceed {MAX_PAIR_MESSAGES} (lower chunks={self.chunks})")
                self._tags[(p.pos, m)] = self.tag_base + p.pos + j * PAIR_SEQ_STRIDE

        # NCCL sub-communicators: every rank, every task, one global order (deduplicated).
        groups: dict[tuple[int, ...], Any] = {}
        if self._nccl and self.strategy == "broadcast":
            for p in self.programs:
                key = tuple(sorted(p.group_ranks))
                if key and key not in groups:
                    groups[key] = dist.new_group([self._global(r) for r in key])
        self._groups = groups

        self._host_of = host_of
        my_host = host_of.get(self.rank)
        chains = nic_side_chains(self.programs, host_of) if my_host is not None else {}
        self._plan_order = self.order == "plan" and not self._nccl
        self._mine: list[_RankTask] = []
        for p in self.programs:
            rt = _RankTask(
                prog=p,
                src_view=(_relative(p.region, self._src_region)
                          if self._src_region is not None and _contains(self._src_region, p.region) else None),
                dst_view=(_relative(p.region, self._dst_region)
                          if self._dst_region is not None and _contains(self._dst_region, p.region) else None),
                copy_local=self.rank in p.local,
            )
            for m in p.msgs:
                if m.dst == self.rank:
                    rt.recvs.append(m)
                if m.src == self.rank:
                    (rt.forwards if m.forward else rt.sends).append(m)
            for m in p.msgs:
                wire = host_of[m.src] != host_of[m.dst]
                if m.dst == self.rank and wire:
                    rt.wire_recvs.append(m)
                if m.src == self.rank:
                    if m.forward:
                        (rt.wire_fwds if wire else rt.intra_fwds).append(m)
                    elif wire:
                        rt.wire_sends.append(m)
            if p.group_ranks and self.rank in p.group_ranks:
                rt.in_nccl_group = True
                rt.nccl_group = groups[tuple(sorted(p.group_ranks))]
            if rt.sends and rt.src_view is None:
                raise AssertionError(f"rank {self.rank} sends task {p.index} but its shard does not hold it")
            if (rt.recvs or rt.copy_local or rt.in_nccl_group) and self.rank != p.sender and rt.dst_view is None:
                raise AssertionError(f"rank {self.rank} receives task {p.index} outside its destination shard")
            if rt.copy_local or rt.sends or rt.recvs or rt.forwards or rt.in_nccl_group:
                self._mine.append(rt)
        # plan order: where this rank sits in the chains of its host's two NIC sides
        by_pos = {rt.prog.pos: rt for rt in self._mine}
        for side in (SEND_SIDE, RECV_SIDE):
            chain = chains.get((my_host, side), [])
            for i, (pos, users) in enumerate(chain):
                if self.rank not in users:
                    continue
                rt = by_pos[pos]
                if i > 0:
                    prev_pos, prev_users = chain[i - 1]
                    rt.gate[side] = (prev_pos if self.rank in prev_users else None,
                                     tuple(sorted(prev_users - {self.rank})))
                if i + 1 < len(chain):
                    next_pos, next_users = chain[i + 1]
                    rt.signal[side] = (next_pos, tuple(sorted(next_users - {self.rank})))
        # receive buffers for slices that are not contiguous inside the output (cached, pooled)
        self._pool: list[dict[int, torch.Tensor]] = [self._new_buffers()]
        self._lock = threading.Lock()
        self._last_threads: dict[int, threading.Thread] = {}  # task position -> latest forward thread

    # ------------------------------------------------------------------ construction helpers
    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _agree_on_order(self, plan: "ReshardingPlan") -> list[tuple[int, int | None]]:
        """Use rank 0's task order and senders on every rank.

        Schedulers with a time budget (dfs) may decide differently on different ranks;
        executing different orders would deadlock, so rank 0's decisions win. A plan for a
        different problem on some rank is an error on every rank.
        """
        desc = (self.shape, repr(plan.src_mesh), str(plan.src_spec), repr(plan.dst_mesh),
                str(plan.dst_spec), plan.strategy, sorted((t.index, tuple((s.start, s.stop) for s in t.slice))
                                                          for t in plan.tasks))
        mine = (desc, [(t.index, t.sender) for t in plan.tasks])
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        for r, (d, _) in enumerate(gathered):
            if d != gathered[0][0]:
                raise ValueError(f"rank {r} built its Resharder from a plan for a different problem than rank 0 "
                                 f"(rank 0: shape {gathered[0][0][0]} {gathered[0][0][2]} -> {gathered[0][0][4]} "
                                 f"{gathered[0][0][5]}; rank {r}: shape {d[0]} {d[2]} -> {d[4]} {d[5]})")
        return list(gathered[0][1])

    def _new_buffers(self) -> dict[int, torch.Tensor]:
        bufs: dict[int, torch.Tensor] = {}
        for rt in self._mine:
            needs = rt.recvs or (rt.in_nccl_group and self.rank != rt.prog.sender)
            if not needs:
                continue
            if self.strategy == "signal":
                bufs[rt.prog.pos] = torch.empty(1, dtype=torch.uint8)
            elif not self._view_is_contiguous(rt):
                bufs[rt.prog.pos] = torch.empty(rt.prog.numel, dtype=self.dtype, device=self._device())
        return bufs

    def _device(self) -> torch.device:
        if self._nccl:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _view_is_contiguous(self, rt: _RankTask) -> bool:
        assert self.dst_shape is not None and rt.dst_view is not None
        return torch.empty(self.dst_shape, device="meta")[rt.dst_view].is_contiguous()

    def _release(self, bufs: dict[int, torch.Tensor]) -> None:
        with self._lock:
            self._pool.append(bufs)

    # ------------------------------------------------------------------ running
    def _check_input(self, local_src: torch.Tensor | None) -> None:
        r = self.rank
        if self.src_shape is None:
            if local_src is not None:
                raise ValueError(f"rank {r} is not in the source mesh {self.plan.src_mesh} "
                                 f"(ranks {list(self.plan.src_mesh.flat_ranks)}) but was given a tensor of "
                                 f"shape {tuple(getattr(local_src, 'shape', ()))}; pass None")
            return
        if local_src is None:
            raise ValueError(f"rank {r} is in the source mesh and must pass its shard of shape {self.src_shape} "
                             f"({self.dtype}), got None")
        if not isinstance(local_src, torch.Tensor):
            raise TypeError(f"rank {r}: local_src must be a torch.Tensor, got {type(local_src).__name__}")
        if tuple(local_src.shape) != self.src_shape:
            raise ValueError(f"rank {r}: local source shard has shape {tuple(local_src.shape)}, expected "
                             f"{self.src_shape} (the {self.plan.src_spec} shard on mesh {self.plan.src_mesh} "
                             f"of global shape {self.shape})")
        if local_src.dtype != self.dtype:
            raise ValueError(f"rank {r}: local source shard has dtype {local_src.dtype}, expected {self.dtype}")

    def run(self, local_src: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's destination shard (None if not in the destination mesh)."""
        return self.start(local_src).wait()

    def start(self, local_src: torch.Tensor | None) -> ReshardHandle:
        """Post this rank's operations and return at once; `handle.wait()` gives the shard."""
        self._check_input(local_src)
        out = None
        if self.dst_shape is not None:
            out = torch.empty(self.dst_shape, dtype=self.dtype, device=self._device())
        with self._lock:
            bufs = self._pool.pop() if self._pool else self._new_buffers()
        works: list[Any] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        keep: list[Any] = []
        if self._plan_order:
            return self._start_plan(local_src, out, bufs, works, copies, keep)
        forwards: dict[int, list[tuple[_Msg, int, torch.Tensor, Any]]] = {}  # pos -> (msg, tag, buffer, recv work)
        for rt in self._mine:
            p = rt.prog
            recv_flat, send_flat = self._flats(rt, local_src, out, bufs, copies, keep)
            if rt.in_nccl_group:
                buf = send_flat if self.rank == p.sender else recv_flat
                works.append(dist.broadcast(buf, src=self._global(p.sender), group=rt.nccl_group, async_op=True))
                continue
            recv_work: dict[tuple[int, int], Any] = {}
            for m in p.msgs:  # global order; this rank's direct ops only
                if m.dst == self.rank:
                    w = dist.irecv(recv_flat[m.start:m.stop], src=self._global(m.src), tag=self._tags[(p.pos, m)])
                    works.append(w)
                    recv_work[(m.start, m.stop)] = w
                elif m.src == self.rank and not m.forward:
                    works.append(dist.isend(send_flat[m.start:m.stop], dst=self._global(m.dst),
                                            tag=self._tags[(p.pos, m)]))
                elif m.src == self.rank:
                    forwards.setdefault(p.pos, []).append((m, self._tags[(p.pos, m)], recv_flat,
                                                           recv_work.get((m.start, m.stop))))
        # local copies (overlapping meshes) while the network works
        for rt in self._mine:
            if rt.copy_local and self.strategy != "signal":
                out[rt.dst_view].copy_(local_src[rt.src_view])
        threads: list[threading.Thread] = []
        errors: list[BaseException] = []
        waited: dict[int, Any] = {}
        for pos, fw in forwards.items():
            t = threading.Thread(target=self._forward, args=(fw, works, errors, waited, self._last_threads.get(pos)),
                                 name=f"reshard-fwd-r{self.rank}-t{pos}", daemon=True)
            t.start()
            self._last_threads[pos] = t
            threads.append(t)
        return ReshardHandle(self, out, works, copies, threads, errors, keep, bufs, waited)

    _SIGNAL_BYTE = torch.zeros(1, dtype=torch.uint8)  # payload of signal sends (never written)

    def _flats(self, rt: _RankTask, local_src: torch.Tensor | None, out: torch.Tensor | None,
               bufs: dict[int, torch.Tensor], copies: list, keep: list) -> tuple[Any, Any]:
        """Where this rank's copy of the task's slice lives (flat), and what it sends from."""
        p = rt.prog
        recv_flat = None
        if rt.recvs or (rt.in_nccl_group and self.rank != p.sender):
            if p.pos in bufs:
                recv_flat = bufs[p.pos]
                if self.strategy != "signal":
                    copies.append((out[rt.dst_view], recv_flat))
            else:
                recv_flat = out[rt.dst_view].view(-1)
        send_flat = None
        if rt.sends or (rt.in_nccl_group and self.rank == p.sender):
            if self.strategy == "signal":
                send_flat = self._SIGNAL_BYTE
            else:
                send_flat = local_src[rt.src_view].contiguous().view(-1)
            keep.append(send_flat)
        return recv_flat, send_flat

    # ------------------------------------------------------------------ plan order
    def _start_plan(self, local_src: torch.Tensor | None, out: torch.Tensor | None, bufs: dict[int, torch.Tensor],
                    works: list[Any], copies: list, keep: list) -> ReshardHandle:
        """Post intra-host operations now; gate wire operations per NIC side in progress threads."""
        run = _PlanRun(works)
        host = self._host_of
        jobs: list[tuple[str, int, Any]] = []
        for rt in self._mine:
            p = rt.prog
            recv_flat, send_flat = self._flats(rt, local_src, out, bufs, copies, keep)
            rw: dict[tuple[int, int], Any] = {}
            for m in p.msgs:  # global order; intra-host direct operations only
                if host[m.src] != host[m.dst]:
                    continue
                if m.dst == self.rank:
                    w = dist.irecv(recv_flat[m.start:m.stop], src=self._global(m.src), tag=self._tags[(p.pos, m)])
                    works.append(w)
                    rw[(m.start, m.stop)] = w
                elif m.src == self.rank and not m.forward:
                    works.append(dist.isend(send_flat[m.start:m.stop], dst=self._global(m.dst),
                                            tag=self._tags[(p.pos, m)]))
            for side in (SEND_SIDE, RECV_SIDE):
                if side in rt.gate or side in rt.signal:
                    run.side_done[(p.pos, side)] = threading.Event()
            for m in rt.wire_fwds:
                run.arrived.setdefault((p.pos, m.start, m.stop), threading.Event())
            if rt.wire_recvs or rt.intra_fwds or rt.wire_fwds:
                jobs.append(("rx", p.pos, (self._plan_rx, rt, run, rw, recv_flat)))
            if rt.wire_sends or rt.wire_fwds:
                jobs.append(("tx", p.pos, (self._plan_tx, rt, run, send_flat, recv_flat)))
        for rt in self._mine:  # local copies (overlapping meshes) while the network works
            if rt.copy_local and self.strategy != "signal":
                out[rt.dst_view].copy_(local_src[rt.src_view])
        threads: list[threading.Thread] = []
        for kind, pos, (fn, *args) in jobs:
            key = (pos, kind)
            t = threading.Thread(target=self._plan_thread, args=(fn, args, run, self._last_threads.get(key)),
                                 name=f"reshard-{kind}-r{self.rank}-t{pos}", daemon=True)
            t.start()
            self._last_threads[key] = t
            threads.append(t)
        h = ReshardHandle(self, out, works, copies, threads, run.errors, keep, bufs, run.waited)
        h.trace = run.trace
        return h

    def _plan_thread(self, fn: Any, args: tuple, run: "_PlanRun", previous: threading.Thread | None) -> None:
        rt = args[0]
        try:
            if previous is not None:
                previous.join()  # the same task's thread of the previous run: FIFO per (pair, tag)
            fn(*args)
        except BaseException as e:  # surfaced by wait()
            run.errors.append(e)
        finally:  # never leave this rank's other threads waiting on a failed one
            if run.errors:
                for side in (SEND_SIDE, RECV_SIDE):
                    ev = run.side_done.get((rt.prog.pos, side))
                    if ev is not None:
                        ev.set()
                for (pos, _, _), ev in run.arrived.items():
                    if pos == rt.prog.pos:
                        ev.set()

    def _gate(self, rt: _RankTask, side: int, run: "_PlanRun") -> None:
        """Wait until the previous task on this host's NIC `side` is done on every rank that used it."""
        if side not in rt.gate:
            return
        prev_pos, others = rt.gate[side]
        if prev_pos is not None:
            run.side_done[(prev_pos, side)].wait()
        if others:
            tag = TOKEN_TAG_BASE + 2 * (self.tag_base + rt.prog.pos) + side
            tok = torch.empty(len(others), dtype=torch.uint8)
            ws = [dist.irecv(tok[i:i + 1], src=self._global(r), tag=tag) for i, r in enumerate(others)]
            for w in ws:
                w.wait()
        if run.errors:
            raise RuntimeError("another progress thread of this run failed")

    def _release_side(self, rt: _RankTask, side: int, run: "_PlanRun") -> list[Any]:
        """This rank is done with the task on `side`: tell the side's next users (returns token sends)."""
        ev = run.side_done.get((rt.prog.pos, side))
        if ev is not None:
            ev.set()
        if side not in rt.signal:
            return []
        next_pos, others = rt.signal[side]
        tag = TOKEN_TAG_BASE + 2 * (self.tag_base + next_pos) + side
        return [dist.isend(self._SIGNAL_BYTE, dst=self._global(r), tag=tag) for r in others]

    def _trace(self, run: "_PlanRun", rt: _RankTask, side: int, t_post: float, t_done: float) -> None:
        if self.trace:
            run.trace.append({"pos": rt.prog.pos, "task": rt.prog.index, "rank": self.rank,
                              "host": self._host_of[self.rank], "side": "send" if side == SEND_SIDE else "recv",
                              "t_post": t_post, "t_done": t_done})

    def _plan_rx(self, rt: _RankTask, run: "_PlanRun", rw: dict[tuple[int, int], Any], flat: Any) -> None:
        """Receive side: gate, post wire receives, pass each piece on as it arrives, release the side."""
        p = rt.prog
        tags = self._tags
        tokens: list[Any] = []
        t_post = 0.0
        if rt.wire_recvs:
            self._gate(rt, RECV_SIDE, run)
            t_post = time.monotonic()
            for m in rt.wire_recvs:
                rw[(m.start, m.stop)] = dist.irecv(flat[m.start:m.stop], src=self._global(m.src),
                                                   tag=tags[(p.pos, m)])
        wire_left = {(m.start, m.stop) for m in rt.wire_recvs}
        fan = {}
        for m in rt.intra_fwds:
            fan.setdefault((m.start, m.stop), []).append(m)
        for m in rt.recvs:  # message order
            key = (m.start, m.stop)
            w = rw[key]
            w.wait()
            run.waited[id(w)] = w
            for f in fan.pop(key, ()):
                run.works.append(dist.isend(flat[f.start:f.stop], dst=self._global(f.dst), tag=tags[(p.pos, f)]))
            ev = run.arrived.get((p.pos, m.start, m.stop))
            if ev is not None:
                ev.set()
            if key in wire_left:
                wire_left.discard(key)
                if not wire_left:
                    self._trace(run, rt, RECV_SIDE, t_post, time.monotonic())
                    tokens += self._release_side(rt, RECV_SIDE, run)
        if fan:
            raise AssertionError(f"rank {self.rank}: forward of {sorted(fan)} without a matching receive")
        for w in tokens:
            w.wait()

    def _plan_tx(self, rt: _RankTask, run: "_PlanRun", send_flat: Any, recv_flat: Any) -> None:
        """Send side: gate, post direct sends, forward chunks as they arrive, wait, release the side."""
        p = rt.prog
        tags = self._tags
        self._gate(rt, SEND_SIDE, run)
        t_post = time.monotonic()
        sends = [dist.isend(send_flat[m.start:m.stop], dst=self._global(m.dst), tag=tags[(p.pos, m)])
                 for m in rt.wire_sends]
        for m in rt.wire_fwds:
            run.arrived[(p.pos, m.start, m.stop)].wait()
            if run.errors:
                raise RuntimeError("another progress thread of this run failed")
            sends.append(dist.isend(recv_flat[m.start:m.stop], dst=self._global(m.dst), tag=tags[(p.pos, m)]))
        for w in sends:
            w.wait()
        self._trace(run, rt, SEND_SIDE, t_post, time.monotonic())
        for w in self._release_side(rt, SEND_SIDE, run):
            w.wait()

    def _forward(self, forwards: list[tuple[_Msg, int, torch.Tensor, Any]], works: list[Any],
                 errors: list[BaseException], waited: dict[int, Any], previous: threading.Thread | None) -> None:
        """Pass on each chunk of one task as soon as it has arrived, in message order (progress thread)."""
        try:
            if previous is not None:
                previous.join()  # FIFO across runs of this Resharder
            sent: list[Any] = []
            for m, tag, flat, rw in forwards:
                if rw is None:
                    raise AssertionError(f"rank {self.rank}: forward of [{m.start},{m.stop}) without a matching receive")
                if id(rw) not in waited:
                    rw.wait()
                    waited[id(rw)] = rw
                sent.append(dist.isend(flat[m.start:m.stop], dst=self._global(m.dst), tag=tag))
            works.extend(sent)
        except BaseException as e:  # surfaced by wait()
            errors.append(e)

    # ------------------------------------------------------------------ introspection
    def describe(self) -> str:
        """Per-task message counts for this rank (for logs)."""
        lines = [f"Resharder rank {self.rank}: {self.strategy}, {len(self.programs)} tasks, chunks {self.chunks}, "
                 f"order {self.order}{' (not enforced on NCCL)' if self.order == 'plan' and self._nccl else ''}"]
        for rt in self._mine:
            lines.append(f"  task {rt.prog.index}: send {len(rt.sends)} recv {len(rt.recvs)} "
                         f"forward {len(rt.forwards)} local {int(rt.copy_local)}")
        return "\n".join(lines)
