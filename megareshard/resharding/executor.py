"""Execute a cross-mesh resharding plan with torch.distributed, under NCCL's rules.

A `Resharder` is built once per (plan, dtype) — collectively, on every rank of the
default process group — and then run every microbatch:

    resharder = Resharder(plan, torch.float32)
    out = resharder.run(local_src)          # or: h = resharder.start(local_src); ...; h.wait()

This module holds the `Resharder`: its construction, its runs and their concurrent-order stream items. What
each rank runs of the plan is compiled by `programs.py`; the plan-order stream items are `plan_order.py`'s.

**The rules it is built to** (NCCL's, kept on gloo too and checked there by
`megareshard.parallel.nccl_check`): point-to-point messages between two ranks pair up in
issue order (no tags: every tag is 0); every member of a communicator issues the same
operations in the same order; one thread drives a communicator.

* **Communicators by participant set** (`streams.py`): every unit task runs on the communicator of its
  participants — its sending rank, the receivers it serves over the network — and of the ranks that forward
  in it, keyed ``(participants, forwarders)``. Tasks (of any Resharder sharing a `CommStreams`) with the same
  key share one communicator, so their number is bounded by the distinct sets, never by tasks or
  microbatches. The two directions of a pipeline edge between two one-rank ends have the same key and share
  their communicator, so a send and a receive with one peer can go out as one group; which receives a rank
  may post when on such a communicator is the pipeline's posting plan (`pipeline/posting.py`), proven
  against NCCL's issue-order rule. All communicators are created at construction, in the plan's global task
  order, identically on every rank (`dist.new_group` is collective).
* **Who issues.** A rank's operations on a communicator it forwards on (a broadcast chain hop, an
  intra-host fan-out, an all-gather exchange: it must wait for data before sending it on) are issued by
  that communicator's one *stream thread*, in FIFO order of the runs submitted to it (a CUDA stream's
  semantics): per run every receive first, then the sends in global message order, a forward after the
  receive that brought its data — blocking only this communicator's thread. Every other operation — pure
  receives, direct sends — is issued inline by the thread that calls ``start()`` (no hand-off), one group
  per communicator: ``start(post=False)`` holds them until `ReshardHandle.post`, `post_together` (several
  runs' operations in one group per communicator) or ``wait()``. The key names the forwarders, so a
  communicator is driven by one thread on each rank whatever Resharder uses it. Every member of a
  communicator sees the same sequence of runs (the pipeline's lowering guarantees that a receiver posts
  receives in its sender's order), and inside a run the same global message order, so every message
  pairs with the right one by issue order alone.
* **Which device of a host.** The scheduler picks sending *hosts*; the sending rank is the host's holder
  that sends the fewest bytes so far, and successive tasks into a host enter through successive devices
  (`messages.rotate_receivers`), so a host's wire traffic and fan-outs spread over its devices.
* **Strategies** (paper §3.1) come from the registry (`strategies/`): each lays out a task's
  messages (`sendrecv`: sender → every receiver; `allgather`: 1/B of the slice to each of a
  host's B receivers, which then exchange pieces inside the host; `broadcast`: on NCCL one
  ``dist.broadcast`` on the task's communicator, which NCCL pipelines itself, on gloo the
  slice in K chunks along the chain sender → first receiver of each other host, each hop
  forwarding chunk k as soon as it has it and fanning out inside its host). A strategy that
  carries no data (a benchmark's 1-byte bound) sends one placeholder byte per message: **the
  returned tensor then has the right shape but undefined values**. K comes from the plan (per
  task, chosen by the strategy from the network model or fixed by
  ``plan_resharding(..., broadcast_chunks=K)``): one source of truth.
* Data lives on the device of its rank (placeholder bytes and receive buffers too). A destination
  rank that holds a slice in its own source shard copies it locally.

**Execution order** (`order=`):

* `"concurrent"` (default): every stream runs as soon as it can. TCP fair-shares each NIC
  among the flows that cross it; only the plan's *sender choice* matters.
* `"plan"`: the paper's model (§3.2) and `NetworkModel.predict`'s — one NIC side (send or
  receive) of a host serves one task at a time, in plan order. A message is a *wire*
  message when its two ranks sit on different hosts. Per NIC side, the tasks whose wire
  messages use it form a chain in plan order; a task's wire operations on a side are
  posted only after every rank that used that side for the previous task of the chain has
  completed its operations there. Hand-overs inside a rank are events; between two ranks
  of a host they are 1-byte token messages on one token communicator per host, issued by
  that communicator's own thread in the receivers' (task, side) order. Every wait points to
  an earlier task on the same side or to the same task's upstream data: no deadlock. A
  send side is released when the sender's send completes (the bytes entered the socket
  buffer), the receive side exactly. gloo only: on NCCL a transfer completes on the GPU
  stream, and gating the next one on it would need a CUDA-event poll per transfer, which is
  not built — "plan" raises there rather than silently running "concurrent".

With ``trace=True`` (gloo) a run records in ``handle.trace`` when its wire operations were posted and when
they completed: in `plan` order one record per (task, NIC side) this rank used; in `concurrent` order one per
wire operation (``peer`` added), each waited by a thread of its own so that its completion time is its own
(gloo marks a transfer complete only inside ``wait()``, and waiting in issue order would date each by the
slowest before it) — a timeline for diagnosis, whose threads cost the run time. Don't modify
``local_src`` before ``wait()`` (contiguous slices of it are sent without a copy).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..parallel.nccl_check import set_label
from .agree import agree_on_orders
from .handle import ReshardHandle, RunState, await_entry, post_together
from .messages import DEFAULT_ORDER, ORDERS, RECV_SIDE, SEND_SIDE, _Msg, _RankTask, _shape, _TaskProgram, comm_key
from .plan_order import PlanOrderItems
from .programs import communicator_items, nic_gates, rank_tasks, task_programs
from .spec import local_slices
from .streams import CommStreams, GroupKey, Op
from .strategies import get_strategy

if TYPE_CHECKING:  # pragma: no cover
    from .plan import ReshardingPlan

__all__ = ["Resharder", "ReshardHandle", "CommStreams", "agree_on_orders", "post_together"]


# ---------------------------------------------------------------------------------- Resharder
class Resharder(PlanOrderItems):
    """Runs one `ReshardingPlan` for tensors of one dtype; construction is collective.

    Every rank of the default process group must construct it, in the same order as its
    other collectives, even ranks in neither mesh. Mesh ranks are ranks of `group`
    (default: the world). `streams` is the job's `CommStreams` (default: the process's
    shared one). Broadcast chunk counts come from the plan (`UnitTask.chunks`). `name`
    labels its messages (logs, the NCCL checking mode).
    """

    def __init__(self, plan: "ReshardingPlan", dtype: torch.dtype, *,
                 group: Any = None, sync_plan: bool = True, order: str | None = None, trace: bool = False,
                 streams: CommStreams | None = None, name: str = "", key_suffix: tuple = (),
                 agreed_order: list[tuple[int, int | None]] | None = None) -> None:
        order = DEFAULT_ORDER if order is None else order
        if order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        strat = get_strategy(plan.strategy)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        if not dist.is_initialized():
            raise RuntimeError("Resharder needs an initialised torch.distributed process group")
        self._nccl = dist.get_backend(group) == "nccl"
        backend = dist.get_backend(group)
        if backend not in strat.backends:
            raise ValueError(f"strategy {strat.name!r} runs on {', '.join(sorted(strat.backends))}, not {backend}")
        if trace and self._nccl:
            raise ValueError("trace=True is gloo-only: a transfer's completion is a CPU-side event there; on NCCL it "
                             "happens on the GPU stream (a CUDA-event poll per transfer, not built)")
        if order == "plan" and self._nccl:
            raise ValueError("order='plan' is gloo-only: it gates each host NIC side on the CPU-side completion of "
                             "the previous transfer, which on NCCL happens on the GPU stream (a CUDA-event poll per "
                             "transfer, not built); use order='concurrent' (the default)")
        self.plan = plan
        self.dtype = dtype
        self.strategy = plan.strategy
        self._strat = strat
        self.group = group
        self.order = order
        self.trace = bool(trace)
        self._watching = self.trace and order == "concurrent"  # trace=True in concurrent order: watcher threads
        self.rank = dist.get_rank(group) if group is not None else dist.get_rank()
        world = dist.get_world_size(group) if group is not None else dist.get_world_size()
        self.shape = tuple(int(s) for s in plan.shape)
        all_ranks = set(plan.src_mesh.flat_ranks) | set(plan.dst_mesh.flat_ranks)
        if max(all_ranks) >= world:
            raise ValueError(f"the meshes use rank {max(all_ranks)} but the process group has {world} ranks")
        self.streams = streams if streams is not None else CommStreams.shared()
        self.name = name or f"reshard{self.streams.next_index()}"  # the same on every rank: constructed in one order
        if agreed_order is not None:  # agreed by the caller, for many plans in one collective (agree_on_orders)
            task_order = list(agreed_order)
        else:
            task_order = agree_on_orders([plan])[0] if sync_plan else [(t.index, t.sender) for t in plan.tasks]

        self._src_region = local_slices(self.shape, plan.src_mesh, plan.src_spec, self.rank)
        self._dst_region = local_slices(self.shape, plan.dst_mesh, plan.dst_spec, self.rank)
        self.src_shape = None if self._src_region is None else _shape(self._src_region)
        self.dst_shape = None if self._dst_region is None else _shape(self._dst_region)

        host_of = {r: plan.dst_mesh.host_of(r) for r in plan.dst_mesh.flat_ranks}
        host_of.update({r: plan.src_mesh.host_of(r) for r in plan.src_mesh.flat_ranks})
        self._host_of = host_of
        self.programs: list[_TaskProgram] = task_programs(plan, task_order, host_of, self.strategy,
                                                          self._nccl and strat.nccl_broadcast)

        # communicators: every rank, every task, one global order (deduplicated by key)
        self._plan_order = self.order == "plan"
        self._key_suffix = tuple(key_suffix)
        self._group_of: dict[GroupKey, Any] = {}
        for p in self.programs:
            key = self.comm_key(p)
            if key is not None:
                self._group_of[key] = self.streams.group(key, [self._global(r) for r in p.group_ranks])
        hosts_ranks: dict[int, list[int]] = {}
        for r in sorted(all_ranks):
            hosts_ranks.setdefault(host_of[r], []).append(r)
        self._token_key: Any = None
        if self._plan_order:  # one token communicator per host (collective: every host, sorted)
            for h in sorted(hosts_ranks):
                rs = tuple(hosts_ranks[h])
                if len(rs) > 1:
                    key = ("tokens", rs)
                    g = self.streams.group(key, [self._global(r) for r in rs])
                    if self.rank in rs:
                        self._token_key, self._token_group = key, g

        self._mine: list[_RankTask] = rank_tasks(self.programs, self.rank, self._src_region, self._dst_region,
                                                 host_of, self.comm_key)
        # this rank's items: its tasks grouped by communicator, in order of first appearance; issued inline
        # unless this rank forwards on the communicator (or runs plan order): then by its stream thread
        self._items, self._threaded = communicator_items(self._mine, self._plan_order)
        # plan order: where this rank sits in the chains of its host's two NIC sides
        self._token_recvs, self._token_sends = nic_gates(self.programs, self._mine, self.rank, host_of)
        self._device = self._pick_device()
        self._one_byte = torch.zeros(1, dtype=torch.uint8, device=self._device)
        # receive buffers for slices that are not contiguous inside the output (cached, pooled)
        self._pool: list[dict[int, torch.Tensor]] = [self._new_buffers()]
        self._lock = threading.Lock()
        self._runs = 0

    # ------------------------------------------------------------------ construction helpers
    def comm_key(self, p: _TaskProgram) -> GroupKey | None:
        """The communicator of task `p` (`messages.comm_key`; a pipeline edge whose directions must stay apart
        appends the sending mesh, ``key_suffix``)."""
        key = comm_key(p, self._plan_order)
        return None if key is None else key + self._key_suffix

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _pick_device(self) -> torch.device:
        if self._nccl:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _new_buffers(self) -> dict[int, torch.Tensor]:
        bufs: dict[int, torch.Tensor] = {}
        for rt in self._mine:
            needs = rt.recvs or (rt.in_nccl_group and self.rank != rt.prog.sender)
            if not needs:
                continue
            if not self._strat.carries_data:  # placeholder messages of one byte
                bufs[rt.prog.pos] = torch.empty(1, dtype=torch.uint8, device=self._device)
            elif not self._view_is_contiguous(rt):
                bufs[rt.prog.pos] = torch.empty(rt.prog.numel, dtype=self.dtype, device=self._device)
        return bufs

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

    def start(self, local_src: torch.Tensor | None, post: bool = True) -> ReshardHandle:
        """Start this rank's part of one run; `handle.wait()` gives the shard.

        Operations on the communicators this rank forwards on go to their stream threads at once (a forward
        waits for its data there); the others are issued from this thread — now, or with ``post=False`` when
        `ReshardHandle.post` / `post_together` / `wait` says (to group them with another run's)."""
        self._check_input(local_src)
        out = None
        if self.dst_shape is not None:
            out = torch.empty(self.dst_shape, dtype=self.dtype, device=self._device)
        with self._lock:
            bufs = self._pool.pop() if self._pool else self._new_buffers()
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        keep: list[Any] = []
        run = RunState()
        n = self._runs
        self._runs += 1
        flats = {rt.prog.pos: self._flats(rt, local_src, out, bufs, copies, keep) for rt in self._mine}
        for rt in self._mine:  # local copies (overlapping meshes), on the caller's thread: no communication
            if rt.copy_local and self._strat.carries_data:
                out[rt.dst_view].copy_(local_src[rt.src_view])
        items: list[Any] = []
        if self._plan_order:
            for side in (SEND_SIDE, RECV_SIDE):
                for rt in self._mine:
                    if side in rt.gate or side in rt.signal:
                        run.side_done[(rt.prog.pos, side)] = threading.Event()
            if self._token_key is not None and (self._token_recvs or self._token_sends):
                items.append(self.streams.stream(self._token_key).submit(
                    lambda: self._tokens(run, n)))
            else:
                run.tokens_posted.set()
        pending: list[tuple[GroupKey, list[Op]]] = []
        for key, rts in self._items:
            if self._threaded[key]:
                fn = self._item_plan if self._plan_order else self._item
                items.append(self.streams.stream(key).submit(
                    lambda key=key, rts=rts: fn(self._group_of[key], rts, flats, run, n)))
            else:
                pending.append((key, self._inline_ops(rts, flats, run, n)))
        handle = ReshardHandle(self, out, run, items, copies, keep, bufs, pending)
        if post and pending:
            handle.post()
        return handle

    def _inline_ops(self, rts: list[_RankTask], flats: dict, run: RunState, n: int) -> list[Op]:
        """This rank's operations on one communicator it does not forward on, in the order a stream would
        issue them: every receive, then the sends in global message order (or the task's broadcast)."""
        me = self.rank
        ops: list[Op] = []

        def add(kind: str, flat: Any, peer: int, label: str, p: _TaskProgram | None = None) -> None:
            entry = [None, False]
            run.works.append(entry)
            ops.append(Op(kind, flat, self._global(peer), label, entry))
            if self._watching and p is not None and self._host_of[me] != self._host_of[peer]:
                run.unwatched.append((entry, self._wire_record(p, kind, peer)))

        for rt in rts:
            p = rt.prog
            recv_flat, send_flat = flats[p.pos]
            if rt.in_nccl_group:
                add("bcast", send_flat if me == p.sender else recv_flat, p.sender, f"{self.name}#{n}/t{p.index}")
                continue
            for j, m in enumerate(p.msgs):
                if m.dst == me:
                    add("recv", recv_flat[m.start:m.stop], m.src, f"{self.name}#{n}/t{p.index}/m{j}", p)
        for rt in rts:
            p = rt.prog
            send_flat = flats[p.pos][1]
            for j, m in enumerate(p.msgs):
                if m.src == me:  # never a forward: this rank would drive the communicator from its stream
                    add("send", send_flat[m.start:m.stop], m.dst, f"{self.name}#{n}/t{p.index}/m{j}", p)
        return ops

    def _flats(self, rt: _RankTask, local_src: torch.Tensor | None, out: torch.Tensor | None,
               bufs: dict[int, torch.Tensor], copies: list, keep: list) -> tuple[Any, Any]:
        """Where this rank's copy of the task's slice lives (flat), and what it sends from."""
        p = rt.prog
        recv_flat = None
        if rt.recvs or (rt.in_nccl_group and self.rank != p.sender):
            if p.pos in bufs:
                recv_flat = bufs[p.pos]
                if self._strat.carries_data:
                    copies.append((out[rt.dst_view], recv_flat))
            else:
                recv_flat = out[rt.dst_view].view(-1)
        send_flat = None
        if rt.sends or (rt.in_nccl_group and self.rank == p.sender):
            if not self._strat.carries_data:  # a bound: placeholder bytes (`wire_bytes` of them)
                send_flat = self._one_byte
            else:
                send_flat = local_src[rt.src_view].contiguous().view(-1)
            keep.append(send_flat)
        return recv_flat, send_flat

    # ------------------------------------------------------------------ stream items
    def _label(self, n: int, p: _TaskProgram, j: int) -> None:
        set_label(f"{self.name}#{n}/t{p.index}/m{j}")

    def _recv(self, group: Any, run: RunState, n: int, p: _TaskProgram, j: int, m: _Msg, flat: Any) -> list[Any]:
        self._label(n, p, j)
        entry = [dist.irecv(flat[m.start:m.stop], src=self._global(m.src), group=group), False]
        run.works.append(entry)
        if self._watching and self._host_of[m.src] != self._host_of[m.dst]:
            self._watch(run, entry, self._wire_record(p, "recv", m.src))
        return entry

    def _send(self, group: Any, run: RunState, n: int, p: _TaskProgram, j: int, m: _Msg, flat: Any) -> list[Any]:
        self._label(n, p, j)
        entry = [dist.isend(flat[m.start:m.stop], dst=self._global(m.dst), group=group), False]
        run.works.append(entry)
        if self._watching and self._host_of[m.src] != self._host_of[m.dst]:
            self._watch(run, entry, self._wire_record(p, "send", m.dst))
        return entry

    # ------------------------------------------------------------------ concurrent-order trace (gloo)
    def _wire_record(self, p: _TaskProgram, kind: str, peer: int) -> dict[str, Any]:
        return {"pos": p.pos, "task": p.index, "rank": self.rank, "host": self._host_of[self.rank],
                "side": kind, "peer": peer}

    def _watch(self, run: RunState, entry: list[Any], rec: dict[str, Any]) -> None:
        """Wait for this issued operation on a thread of its own and record when it completed."""
        done = threading.Event()
        rec["t_post"] = time.monotonic()
        entry.append(done)

        def wait() -> None:
            try:
                entry[0].wait()
                rec["t_done"] = time.monotonic()
                run.trace.append(rec)
            except BaseException as e:  # raised where the run waits through this watcher
                entry.append(e)
            finally:
                entry[1] = True
                done.set()

        t = threading.Thread(target=wait, name=f"{self.name}-trace", daemon=True)
        run.watchers.append(t)
        t.start()

    def _watch_issued(self, run: RunState) -> None:
        """Watch the inline operations `post_together` has just issued."""
        for entry, rec in run.unwatched:
            self._watch(run, entry, rec)
        run.unwatched.clear()

    def _item(self, group: Any, rts: list[_RankTask], flats: dict, run: RunState, n: int) -> None:
        """Concurrent order (gloo): every receive of these tasks, then the sends in global message order."""
        if self._nccl:
            self._item_nccl(group, rts, flats, run, n)
            return
        me = self.rank
        try:
            recv_of: dict[tuple[int, int, int], list[Any]] = {}
            for rt in rts:
                p = rt.prog
                for j, m in enumerate(p.msgs):
                    if m.dst == me:
                        recv_of[(p.pos, m.start, m.stop)] = self._recv(group, run, n, p, j, m, flats[p.pos][0])
            for rt in rts:
                p = rt.prog
                recv_flat, send_flat = flats[p.pos]
                for j, m in enumerate(p.msgs):
                    if m.src != me:
                        continue
                    if m.forward:  # wait for the data to forward (blocks this communicator's thread only)
                        await_entry(recv_of[(p.pos, m.start, m.stop)])
                        self._send(group, run, n, p, j, m, recv_flat)
                    else:
                        self._send(group, run, n, p, j, m, send_flat)
        finally:
            set_label(None)

    def _item_nccl(self, group: Any, rts: list[_RankTask], flats: dict, run: RunState, n: int) -> None:
        """NCCL: broadcasts as one collective each; otherwise one batch of the direct receives and sends,
        then (after a GPU-stream wait for the data) one batch of the forwards and their receives. Batching
        (ncclGroupStart/End) lets a rank's receive and send on one communicator progress together; issued
        one by one they would queue on the communicator's stream and wait for each other."""
        me = self.rank
        try:
            direct: list[Any] = []
            second: list[Any] = []
            feeds: list[tuple[int, int, int]] = []
            for rt in rts:
                p = rt.prog
                recv_flat, send_flat = flats[p.pos]
                if rt.in_nccl_group:
                    set_label(f"{self.name}#{n}/t{p.index}")
                    buf = send_flat if me == p.sender else recv_flat
                    run.works.append([dist.broadcast(buf, src=self._global(p.sender), group=group, async_op=True),
                                      False])
                    continue
                for m in p.msgs:
                    if m.dst == me:
                        op = dist.P2POp(dist.irecv, recv_flat[m.start:m.stop], self._global(m.src), group)
                        (second if m.forward else direct).append(((p.pos, m.start, m.stop), op))
                    elif m.src == me:
                        flat = recv_flat if m.forward else send_flat
                        op = dist.P2POp(dist.isend, flat[m.start:m.stop], self._global(m.dst), group)
                        (second if m.forward else direct).append((None, op))
                        if m.forward:
                            feeds.append((p.pos, m.start, m.stop))
            recv_of: dict[tuple[int, int, int], list[Any]] = {}
            for batch in (direct, second):
                if batch is second:
                    for key in feeds:  # GPU-stream wait: the batch's kernels run after the data is in
                        recv_of[key][0].wait()
                if not batch:
                    continue
                set_label(f"{self.name}#{n}/{'direct' if batch is direct else 'forward'}")
                works = dist.batch_isend_irecv([op for _, op in batch])
                for (key, _), w in zip(batch, works):
                    entry = [w, False]
                    run.works.append(entry)
                    if key is not None:
                        recv_of[key] = entry
        finally:
            set_label(None)

    # ------------------------------------------------------------------ introspection
    def describe(self) -> str:
        """Per-task message counts for this rank (for logs)."""
        ks = sorted({p.chunks for p in self.programs}) if self._strat.chunks is not None else []
        lines = [f"Resharder {self.name} rank {self.rank}: {self.strategy}, {len(self.programs)} tasks, "
                 f"{len(self._group_of)} communicators, order {self.order}"
                 + (f", broadcast chunks {ks}" if ks else "")]
        for rt in self._mine:
            lines.append(f"  task {rt.prog.index}: send {len(rt.sends)} recv {len(rt.recvs)} "
                         f"forward {len(rt.forwards)} local {int(rt.copy_local)}")
        return "\n".join(lines)
