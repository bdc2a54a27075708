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

Concurrent Resharders whose messages share rank pairs must use disjoint tag ranges
(`tag_base`), since gloo matches by (pair, tag). Don't modify `local_src` before `wait()`
(contiguous slices of it are sent without a copy).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from .spec import local_slices, split_bounds

if TYPE_CHECKING:  # pragma: no cover
    from .plan import ReshardingPlan

STRATEGIES = ("sendrecv", "allgather", "broadcast", "signal")


@dataclass(frozen=True)
class _Msg:
    """One point-to-point message: elements [start, stop) of a task's flattened slice."""

    src: int
    dst: int
    start: int
    stop: int
    forward: bool  # src received this range itself (broadcast hop, fan-out, allgather exchange)


@dataclass
class _TaskProgram:
    """Everything every rank knows about one unit task, in global posting order."""

    pos: int  # position in execution order; the gloo tag is tag_base + pos
    index: int  # the plan's task index
    region: tuple[slice, ...]  # slice of the global tensor
    shape: tuple[int, ...]
    numel: int
    sender: int
    local: tuple[int, ...]  # receivers that already hold the slice: local copy
    msgs: list[_Msg]
    group_ranks: tuple[int, ...] = ()  # NCCL broadcast communicator (sender first)


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
    nccl_group: Any = None
    in_nccl_group: bool = False


def _relative(region: Sequence[slice], base: Sequence[slice]) -> tuple[slice, ...]:
    return tuple(slice(r.start - b.start, r.stop - b.start) for r, b in zip(region, base))


def _contains(outer: Sequence[slice], inner: Sequence[slice]) -> bool:
    return all(o.start <= i.start and i.stop <= o.stop for o, i in zip(outer, inner))


def _shape(region: Sequence[slice]) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in region)


def build_messages(strategy: str, numel: int, sender: int, remote: Sequence[int],
                   host_of: dict[int, int], chunks: int) -> list[_Msg]:
    """The messages of one unit task in global posting order (pure: unit-testable).

    `remote` are the receivers that need the data over the wire (sorted). Receivers on
    the sender's host are served by the sender itself (intra-host), other hosts as the
    strategy says.
    """
    if not remote:
        return []
    if strategy == "signal":
        return [_Msg(sender, r, 0, 1, False) for r in remote]
    if strategy == "sendrecv":
        return [_Msg(sender, r, 0, numel, False) for r in remote]
    sender_host = host_of[sender]
    by_host: dict[int, list[int]] = {}
    for r in remote:
        by_host.setdefault(host_of[r], []).append(r)
    local = by_host.pop(sender_host, [])
    hosts = sorted(by_host)
    msgs: list[_Msg] = []
    if strategy == "allgather":
        for r in local:
            msgs.append(_Msg(sender, r, 0, numel, False))
        for h in hosts:
            rs = by_host[h]
            pieces = split_bounds(numel, len(rs))
            for r, (a, b) in zip(rs, pieces):
                msgs.append(_Msg(sender, r, a, b, False))
            for r, (a, b) in zip(rs, pieces):  # intra-host exchange
                if b > a:
                    msgs.extend(_Msg(r, o, a, b, True) for o in rs if o != r)
        return [m for m in msgs if m.stop > m.start]
    if strategy == "broadcast":
        heads = [by_host[h][0] for h in hosts]
        for a, b in split_bounds(numel, max(1, min(chunks, numel))):
            prev = sender
            for r in local:  # the sender is the head of its own host
                msgs.append(_Msg(sender, r, a, b, False))
            for h, head in zip(hosts, heads):
                msgs.append(_Msg(prev, head, a, b, prev != sender))
                prev = head
            for h, head in zip(hosts, heads):
                msgs.extend(_Msg(head, r, a, b, True) for r in by_host[h][1:])
        return msgs
    raise ValueError(f"strategy {strategy!r} cannot be executed; allowed: {', '.join(STRATEGIES)}")


class ReshardHandle:
    """An in-flight resharding run; `wait()` returns the destination shard (or None)."""

    def __init__(self, owner: "Resharder", out: torch.Tensor | None, works: list[Any],
                 copies: list[tuple[torch.Tensor, torch.Tensor]], threads: list[threading.Thread],
                 errors: list[BaseException], keep: list[Any], bufs: dict[int, torch.Tensor] | None,
                 waited: set[int]) -> None:
        self._owner = owner
        self._waited = waited  # ids of works the progress thread already waited on
        self._out = out
        self._works = works
        self._copies = copies  # (destination view, flat receive buffer) after the data is in
        self._threads = threads
        self._errors = errors
        self._keep = keep  # send payloads must live until the sends complete
        self._bufs = bufs
        self._done = False

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
                 group: Any = None, tag_base: int = 0, sync_plan: bool = True) -> None:
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

        # NCCL sub-communicators: every rank, every task, one global order (deduplicated).
        groups: dict[tuple[int, ...], Any] = {}
        if self._nccl and self.strategy == "broadcast":
            for p in self.programs:
                key = tuple(sorted(p.group_ranks))
                if key and key not in groups:
                    groups[key] = dist.new_group([self._global(r) for r in key])
        self._groups = groups

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
            if p.group_ranks and self.rank in p.group_ranks:
                rt.in_nccl_group = True
                rt.nccl_group = groups[tuple(sorted(p.group_ranks))]
            if rt.sends and rt.src_view is None:
                raise AssertionError(f"rank {self.rank} sends task {p.index} but its shard does not hold it")
            if (rt.recvs or rt.copy_local or rt.in_nccl_group) and self.rank != p.sender and rt.dst_view is None:
                raise AssertionError(f"rank {self.rank} receives task {p.index} outside its destination shard")
            if rt.copy_local or rt.sends or rt.recvs or rt.forwards or rt.in_nccl_group:
                self._mine.append(rt)
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
        forwards: dict[int, list[tuple[_Msg, int, torch.Tensor, Any]]] = {}  # pos -> (msg, tag, buffer, recv work)
        signal_byte = torch.zeros(1, dtype=torch.uint8)
        for rt in self._mine:
            p = rt.prog
            tag = self.tag_base + p.pos
            # where this rank's copy of the slice lives, flat
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
                    send_flat = signal_byte
                else:
                    send_flat = local_src[rt.src_view].contiguous().view(-1)
                keep.append(send_flat)
            if rt.in_nccl_group:
                buf = send_flat if self.rank == p.sender else recv_flat
                works.append(dist.broadcast(buf, src=self._global(p.sender), group=rt.nccl_group, async_op=True))
                continue
            recv_work: dict[tuple[int, int], Any] = {}
            for m in p.msgs:  # global order; this rank's direct ops only
                if m.dst == self.rank:
                    w = dist.irecv(recv_flat[m.start:m.stop], src=self._global(m.src), tag=tag)
                    works.append(w)
                    recv_work[(m.start, m.stop)] = w
                elif m.src == self.rank and not m.forward:
                    works.append(dist.isend(send_flat[m.start:m.stop], dst=self._global(m.dst), tag=tag))
                elif m.src == self.rank:
                    forwards.setdefault(p.pos, []).append((m, tag, recv_flat, recv_work.get((m.start, m.stop))))
        # local copies (overlapping meshes) while the network works
        for rt in self._mine:
            if rt.copy_local and self.strategy != "signal":
                out[rt.dst_view].copy_(local_src[rt.src_view])
        threads: list[threading.Thread] = []
        errors: list[BaseException] = []
        waited: set[int] = set()
        for pos, fw in forwards.items():
            t = threading.Thread(target=self._forward, args=(fw, works, errors, waited, self._last_threads.get(pos)),
                                 name=f"reshard-fwd-r{self.rank}-t{pos}", daemon=True)
            t.start()
            self._last_threads[pos] = t
            threads.append(t)
        return ReshardHandle(self, out, works, copies, threads, errors, keep, bufs, waited)

    def _forward(self, forwards: list[tuple[_Msg, int, torch.Tensor, Any]], works: list[Any],
                 errors: list[BaseException], waited: set[int], previous: threading.Thread | None) -> None:
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
                    waited.add(id(rw))
                sent.append(dist.isend(flat[m.start:m.stop], dst=self._global(m.dst), tag=tag))
            works.extend(sent)
        except BaseException as e:  # surfaced by wait()
            errors.append(e)

    # ------------------------------------------------------------------ introspection
    def describe(self) -> str:
        """Per-task message counts for this rank (for logs)."""
        lines = [f"Resharder rank {self.rank}: {self.strategy}, {len(self.programs)} tasks, chunks {self.chunks}"]
        for rt in self._mine:
            lines.append(f"  task {rt.prog.index}: send {len(rt.sends)} recv {len(rt.recvs)} "
                         f"forward {len(rt.forwards)} local {int(rt.copy_local)}")
        return "\n".join(lines)
