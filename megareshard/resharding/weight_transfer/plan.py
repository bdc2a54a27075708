"""Plan a weight transfer: a model's parameters from a source layout to destination replicas — pure, cached.

Input: the model's parameters (`ParamInfo`), what every source rank holds (`Box`es of the global tensors: tp
slices, ZeRO-3 row chunks, padded vocabularies cut, pipeline stages with virtual stages, per-stage meshes — any
set of boxes that covers every tensor), one or more destination replicas with the boxes each of their ranks needs,
the host of every rank, a bucket size. Output: a `TransferPlan`, what every rank does, in one global order.

1. **Decompose** every parameter as the resharding library does (`decompose_boxes`: the cut points of the
   source and destination boxes split each dim; each cell is a unit task with its holders and its receivers
   over *all* replicas, so bytes two replicas need are one task).
2. **Local copies**: a receiver that holds the slice itself (same ranks: an in-memory relayout) copies it.
3. **Pieces**: a task with remote receivers is split along its outer dims into at least as many pieces as it has
   holders, none larger than a bucket, so a replicated weight (dp replicas, ZeRO 0-2) leaves from every
   replica and a ZeRO-3 shard from its owner.
4. **Senders**: one sending host per piece by the library's scheduler (`schedulers.run_scheduler`, default
   ``loadbalance``: longest piece first to the least-loaded NIC, costed by the strategy's `task_cost`), then the
   host's holder that has sent least — every source rank and NIC works.
5. **Buckets**: ``bucket_mb`` bounds what a rank stages at once. A rank that receives from S holders (S at
   most 8, the *streams*) should be able to receive from all of them at once, two buckets of each at a time
   (step 6), so buckets are ``bucket_mb / 2S``:
   pieces with the same (sender, remote receivers, dtype) are packed into flat buckets of at most that, a
   route's bytes in as few buckets as fit and about equal ones (no small last bucket to wait for); a bucket
   travels by the registered strategy's messages: ``broadcast``, the pipelined chain through the receiving
   hosts in K chunks from the network model, fanned out inside each host (successive buckets to the same hosts
   enter them at successive hosts, so the receiving hosts share the forwarding), or ``sendrecv``, one message
   to each receiver; the default ``auto`` plans both and keeps the one whose busiest NIC side carries fewer
   bytes, direct sends unless the chain saves more than a bucket there (no forwarding hop).
6. **Streams and steps**: each route sends its buckets one after the other, the next leaving the sender as
   soon as the previous has, and all routes at once from the start, so every source NIC works and no
   boundary drains the pipelines — when that fits ``bucket_mb`` (it does when no rank is in more routes than it
   has holders); otherwise in waves that keep every rank within ``bucket_mb``. A message's step is its
   chunk's turn on its (sender, receiver) pair, a forward one step after the message that brought its data —
   one batch of point-to-point operations per rank and step, the same global order on every rank
   (`execute.py`).

The plan is validated once, printable (`describe`) and cached (`plan_weight_transfer`) under a key of
everything that determines it; `key` is its digest, which the executor checks on every rank.
"""
from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..decompose import UnitTask, cells
from ..messages import build_messages, rotate_receivers
from ..network import NetworkModel, task_cost
from ..schedulers import Option, SchedTask, get_scheduler, run_scheduler
from ..strategies import get_strategy
from ..wire import RECV, SEND, TaskCost
from .boxes import ITEMSIZE, Box, ParamInfo

__all__ = ["Replica", "Bucket", "TransferPlan", "plan_weight_transfer", "decompose_boxes", "clear_plan_cache"]

Region = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Replica:
    """One destination replica: its name and the boxes each of its ranks needs."""

    name: str
    boxes: Mapping[int, Sequence[Box]]


@dataclass
class Bucket:
    """Pieces with one sender and one set of remote receivers, packed flat (``entries``: piece index, offset)."""

    index: int
    dtype: str
    sender: int
    receivers: tuple[int, ...]  # remote receivers, in the strategy's order (rotated per host)
    entries: list[tuple[int, int]]  # (piece index, element offset in the flat bucket)
    numel: int
    chunks: int = 1
    msgs: list = field(default_factory=list)  # wire.Msg, in global posting order
    steps: list[int] = field(default_factory=list)  # per message: its global step
    wave: int = 0  # its index in its route (streams) or its wave (`_schedule`)


def decompose_boxes(name: str, shape: Sequence[int], src: Mapping[int, Region], dst: Mapping[int, Region],
                    itemsize: int) -> list[UnitTask]:
    """The library's decomposition (`decompose.decompose`) over arbitrary boxes: per dim the cut points of every
    source and destination region split it; each cell that some destination needs is a `UnitTask` with its
    holders (``senders``) and needers (``receivers``). Every needed cell must be held somewhere."""
    shp = tuple(int(s) for s in shape)
    tasks: list[UnitTask] = []
    for sl, senders, receivers in cells(shp, dict(src), dict(dst)):
        if not senders:
            cell = ", ".join(f"{s.start}:{s.stop}" for s in sl)
            raise ValueError(f"parameter {name} {shp}: no source rank holds [{cell}] that rank(s) "
                             f"{sorted(receivers)} need (the source boxes do not cover the tensor)")
        t = UnitTask(index=len(tasks), slice=sl, senders=tuple(sorted(senders)), receivers=tuple(sorted(receivers)))
        t.nbytes = t.numel * itemsize
        tasks.append(t)
    return tasks


def _split(region: Region, parts: int, max_numel: int) -> list[Region]:
    """``region`` cut along its outer dims into at least ``parts`` pieces (where rows allow) of at most
    ``max_numel`` elements each (a piece is a box: packing and unpacking stay box copies)."""
    numel = 1
    for a, b in region:
        numel *= b - a
    if numel <= max_numel and parts <= 1:
        return [region]
    for d, (a, b) in enumerate(region):
        if b - a > 1:
            inner = numel // (b - a)
            n = max(parts, -(-numel // max_numel))
            n = min(n, b - a)
            q, r = divmod(b - a, n)
            out, start = [], a
            for k in range(n):
                stop = start + q + (1 if k < r else 0)
                sub = region[:d] + ((start, stop),) + region[d + 1:]
                out += _split(sub, 1, max_numel) if (stop - start) * inner > max_numel else [sub]
                start = stop
            return out
    return [region]  # one element: cannot be smaller


@dataclass
class TransferPlan:
    """What every rank does in one weight transfer (see the module docstring). Pure data."""

    key: str
    params: tuple[ParamInfo, ...]
    source: dict[int, dict[str, Box]]  # rank -> name -> the box it sends from
    dest: dict[int, dict[str, Box]]  # rank -> name -> the box it receives into
    aliases: dict[int, list[Box]]  # rank -> further boxes of a name it receives once (a tied copy)
    replicas: tuple[str, ...]
    replica_ranks: dict[str, tuple[int, ...]]
    hosts: dict[int, int]  # rank -> host
    strategy: str
    scheduler: str
    bucket_bytes: int  # the staging bound per rank (``bucket_mb``)
    streams: int  # buckets a rank may stage at once: each bucket holds at most bucket_bytes // streams
    pieces: list[UnitTask]  # every piece with remote receivers, sender chosen
    piece_names: list[str]
    piece_dtypes: list[str]
    local_copies: list[tuple[int, str, Region]]  # (rank, name, region) copied from its own source box
    buckets: list[Bucket]
    num_steps: int
    num_waves: int  # streams: the most buckets of one route; waves (when streams do not fit): the waves
    network: NetworkModel
    _costs: dict[int, TaskCost] = field(default_factory=dict, repr=False)

    # ---- the network model's view (network.PlanView): pieces are its tasks
    @property
    def tasks(self) -> list[UnitTask]:
        return self.pieces

    def task_cost(self, task: UnitTask) -> TaskCost:
        c = self._costs.get(task.index)
        if c is None:
            held = set(task.senders)
            counts = Counter(self.hosts[r] for r in task.receivers if r not in held)
            c = self._costs[task.index] = task_cost(self.strategy, task.nbytes, self.hosts[task.sender],
                                                    dict(counts), task.chunks)
        return c

    def host_of(self, rank: int) -> int:
        return self.hosts[rank]

    def sender_host(self, task: UnitTask) -> int:
        return self.hosts[task.sender]

    # ---- numbers
    @property
    def wire_bytes(self) -> int:
        """Bytes that leave a source rank for another rank (each piece once)."""
        return sum(t.nbytes for t in self.pieces)

    @property
    def delivered_bytes(self) -> int:
        """Bytes every destination rank receives from another rank, summed over ranks."""
        return sum(t.nbytes * sum(1 for r in t.receivers if r not in t.senders) for t in self.pieces)

    def lower_bound_s(self) -> float:
        """The network model's lower bound: the busiest NIC side's bytes over its rate (0 on one host)."""
        return self.network.lower_bound(self)

    def staging_bytes(self) -> dict[int, int]:
        """Per rank, the most bucket bytes it stages at once: a bucket is staged on a rank from its first step
        there to its last (as `execute.py` allocates and frees it)."""
        return _staging(self.buckets)

    def describe(self) -> str:
        """A readable summary: sizes, replicas, senders' load, buckets, waves, the bound."""
        sent: Counter[int] = Counter()
        for t in self.pieces:
            sent[t.sender] += t.nbytes
        srcs = sorted(self.source)
        lines = [f"weight transfer {self.key[:12]}: {len(self.params)} tensors, "
                 f"{sum(p.nbytes for p in self.params) / 2**20:.2f} MiB; strategy {self.strategy}, scheduler "
                 f"{self.scheduler}, staging bound {self.bucket_bytes / 2**20:g} MiB in up to {self.streams} "
                 f"bucket(s) per rank",
                 f"  source ranks {_ranks(srcs)} on hosts {_ranks(sorted({self.hosts[r] for r in srcs}))}"]
        for name in self.replicas:
            rs = self.replica_ranks[name]
            lines.append(f"  replica {name}: ranks {_ranks(rs)} on hosts {_ranks(sorted({self.hosts[r] for r in rs}))}")
        lines.append(f"  {len(self.pieces)} pieces ({self.wire_bytes / 2**20:.2f} MiB leave the sources, "
                     f"{self.delivered_bytes / 2**20:.2f} MiB delivered), {len(self.local_copies)} local copies, "
                     f"{len(self.buckets)} buckets, {self.num_waves} per route at most / {self.num_steps} steps")
        if sent:
            lines.append("  bytes sent per source rank: " + ", ".join(
                f"{r}:{sent.get(r, 0) / 2**20:.2f}M" for r in srcs))
        st = self.staging_bytes()
        if st:
            lines.append(f"  staging at most {max(st.values()) / 2**20:.2f} MiB per rank")
        lines.append(f"  network lower bound {self.lower_bound_s() * 1e3:.2f} ms at {self.network.nic_gbps:g} Gbit/s "
                     f"per host NIC")
        return "\n".join(lines)


def _ranks(rs: Sequence[int]) -> str:
    rs = list(rs)
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"{rs[0]}-{rs[-1]}"
    return ",".join(map(str, rs))


# ---- validation -------------------------------------------------------------------------------------------
def _index_boxes(params: Mapping[str, ParamInfo], boxes: Mapping[int, Sequence[Box]], what: str
                 ) -> tuple[dict[int, dict[str, Box]], dict[int, list[Box]]]:
    """rank -> name -> its box (the first listed); later boxes of the same name on a rank are aliases (a tied copy),
    which must lie inside the first."""
    out: dict[int, dict[str, Box]] = {}
    aliases: dict[int, list[Box]] = {}
    for r, bs in boxes.items():
        mine = out.setdefault(int(r), {})
        for b in bs:
            p = params.get(b.name)
            if p is None:
                raise ValueError(f"{what} rank {r} holds {b.name!r}, which is not a parameter of the model")
            if len(b.region) != len(p.shape) or any(not 0 <= a < z <= s for (a, z), s in zip(b.region, p.shape)):
                raise ValueError(f"{what} rank {r}: box {list(b.region)} of {b.name} lies outside its shape {p.shape}")
            if b.name in mine:
                first = mine[b.name]
                if any(a < fa or z > fz for (a, z), (fa, fz) in zip(b.region, first.region)):
                    raise ValueError(f"{what} rank {r} holds {b.name} twice in different boxes "
                                     f"({list(first.region)} and {list(b.region)})")
                aliases.setdefault(int(r), []).append(b)
            else:
                mine[b.name] = b
    return out, aliases


def _check_ranks(source: Mapping[int, Sequence[Box]], replicas: Sequence[Replica], host_of: Mapping[int, int],
                 allow_overlap: bool) -> None:
    seen: dict[int, str] = {}
    names = [r.name for r in replicas]
    if len(set(names)) != len(names):
        raise ValueError(f"destination replica names must differ, got {names}")
    if not replicas:
        raise ValueError("a weight transfer needs at least one destination replica")
    for rep in replicas:
        for r in rep.boxes:
            if r in seen:
                raise ValueError(f"rank {r} is in destination replicas {seen[r]} and {rep.name}: replicas need "
                                 "disjoint ranks")
            seen[r] = rep.name
    both = sorted(set(seen) & set(source))
    if both and not allow_overlap:
        raise ValueError(f"rank(s) {both} are both source and destination ({seen[both[0]]}) but overlapping ranks "
                         "were not allowed (allow_overlap=False)")
    missing = sorted(r for r in {*seen, *source} if r not in host_of)
    if missing:
        raise ValueError(f"rank(s) {missing} have no host ({len(host_of)} ranks have one)")


# ---- planning -----------------------------------------------------------------------------------------------
_CACHE: "OrderedDict[str, TransferPlan]" = OrderedDict()
_CACHE_SIZE = 8
_MAX_STREAMS = 8  # routes a rank may take part in at once (each bucket bucket_mb / (2·streams))


def clear_plan_cache() -> None:
    _CACHE.clear()


def _key(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def plan_weight_transfer(params: Sequence[ParamInfo], source: Mapping[int, Sequence[Box]],
                         replicas: Sequence[Replica], host_of: Mapping[int, int], *, bucket_mb: float = 64.0,
                         strategy: str = "auto", scheduler: str = "loadbalance", allow_overlap: bool = True,
                         network: NetworkModel | None = None) -> TransferPlan:
    """The plan (module docstring), from the cache when everything that determines it is the same: the
    parameters (names, shapes, dtypes), every box, the replicas, the hosts, the bucket size, the strategy (a
    registered one, or ``auto``: `_auto`), the scheduler, the overlap rule and the network model. Bad input
    raises one line with the numbers."""
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    if strategy == "auto":
        return _auto(params, source, replicas, host_of, bucket_mb=bucket_mb, scheduler=scheduler,
                     allow_overlap=allow_overlap, network=network)
    get_strategy(strategy)
    get_scheduler(scheduler)
    net = network if network is not None else NetworkModel()
    host_of = {int(r): int(h) for r, h in host_of.items()}
    norm = lambda bs: tuple(sorted((int(r), tuple(b)) for r, b in bs.items()))  # noqa: E731
    key = _key(tuple(params), norm(source), tuple((rep.name, norm(rep.boxes)) for rep in replicas),
               tuple(sorted(host_of.items())), float(bucket_mb), strategy, scheduler, bool(allow_overlap),
               (net.nic_gbps, net.intra_gbps, net.latency_s, net.message_overhead_s))
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    plan = _plan(key, list(params), source, list(replicas), host_of, int(bucket_mb * 2**20), strategy, scheduler,
                 allow_overlap, net)
    _CACHE[key] = plan
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return plan


#: what ``strategy="auto"`` chooses from, the first winning ties (direct sends: no forwarding hop)
AUTO_STRATEGIES = ("sendrecv", "broadcast")


def _busiest_side(plan: TransferPlan) -> int:
    """The bytes of the busiest NIC side (a host's out or in) under the plan's strategy and senders."""
    return max((max(o, i) for o, i in plan.network.host_bytes(plan).values()), default=0)


def _auto(params, source, replicas, host_of, **kw) -> TransferPlan:
    """The first plan of `AUTO_STRATEGIES` whose busiest NIC side carries no more than one bucket above the
    fewest bytes any of them does (a difference under a bucket — small tensors placed otherwise — is no
    difference in a transfer that moves whole buckets). Direct sends win where a chain would not unload any NIC
    (every shard to one replica per host, the senders' NICs as free as the receivers'): no forwarding hop; the
    broadcast chain wins where a host holds several replicas or a sender's NIC would carry a shard twice."""
    plans = [plan_weight_transfer(params, source, replicas, host_of, strategy=s, **kw) for s in AUTO_STRATEGIES]
    least = min(_busiest_side(p) for p in plans)
    return next(p for p in plans if _busiest_side(p) <= least + p.bucket_bytes // (2 * p.streams))


def _plan(key: str, params: list[ParamInfo], source: Mapping[int, Sequence[Box]], replicas: list[Replica],
          host_of: dict[int, int], bucket_bytes: int, strategy: str, scheduler: str, allow_overlap: bool,
          net: NetworkModel) -> TransferPlan:
    by_name = {p.name: p for p in params}
    if len(by_name) != len(params):
        dup = sorted(n for n, c in Counter(p.name for p in params).items() if c > 1)
        raise ValueError(f"parameter name(s) {dup[:4]} listed twice")
    _check_ranks(source, replicas, host_of, allow_overlap)
    src, _ = _index_boxes(by_name, source, "source")
    dst: dict[int, dict[str, Box]] = {}
    aliases: dict[int, list[Box]] = {}
    for rep in replicas:
        d, a = _index_boxes(by_name, rep.boxes, f"destination {rep.name}")
        dst.update(d)
        aliases.update(a)
    strat = get_strategy(strategy)
    pieces: list[UnitTask] = []
    names: list[str] = []
    local: list[tuple[int, str, Region]] = []
    tasks: list[tuple[ParamInfo, UnitTask]] = []
    holders: dict[int, set[int]] = {}  # receiving rank -> the ranks holding what it needs from others
    for p in params:
        s = {r: b[p.name].region for r, b in src.items() if p.name in b}
        t = {r: b[p.name].region for r, b in dst.items() if p.name in b}
        if not t:
            continue
        for task in decompose_boxes(p.name, p.shape, s, t, p.itemsize):
            tasks.append((p, task))
            for r in task.receivers:
                if r not in task.senders:
                    holders.setdefault(r, set()).update(task.senders)
    streams = min(_MAX_STREAMS, max((len(h) for h in holders.values()), default=1))
    piece_bytes = max(1, bucket_bytes // (2 * streams))  # two buckets of a route may be staged at once
    for p, task in tasks:
        item = p.itemsize
        region = tuple((sl.start, sl.stop) for sl in task.slice)
        held = set(task.senders)
        local += [(r, p.name, region) for r in task.receivers if r in held]
        if all(r in held for r in task.receivers):
            continue
        n_hold = len({host_of[r] for r in task.senders}) if len(task.senders) > 1 else 1
        parts = max(n_hold, len(task.senders)) if task.nbytes >= 4096 else 1
        for sub in _split(region, parts, max(1, piece_bytes // item)):
            u = UnitTask(index=len(pieces), slice=tuple(slice(a, b) for a, b in sub), senders=task.senders,
                         receivers=task.receivers)
            u.nbytes = u.numel * item
            pieces.append(u)
            names.append(p.name)
    dtypes = [by_name[n].dtype for n in names]
    # senders: the library's scheduler over NIC sides (hosts), then the host's least-loaded holder
    sched_tasks = []
    for u in pieces:
        held = set(u.senders)
        counts = Counter(host_of[r] for r in u.receivers if r not in held)
        cand = sorted({host_of[r] for r in u.senders})
        opts = []
        for h in cand:
            c = task_cost(strategy, u.nbytes, h, dict(counts), 1)
            loads = tuple([((x, SEND), float(b)) for x, b in sorted(c.out_bytes.items())]
                          + [((x, RECV), float(b)) for x, b in sorted(c.in_bytes.items())])
            # the receiving sides are the same whichever host sends: the choice balances the senders' NICs
            opts.append(Option(h, c.nic_bytes, frozenset({(h, SEND)}), loads))
        sched_tasks.append(SchedTask(tuple(opts), naive=0))
    sched = run_scheduler(scheduler, sched_tasks, order="concurrent", time_budget_s=1.0, seed=0) if pieces else None
    sent: Counter[int] = Counter()
    for pos in (sched.order if sched else []):
        u = pieces[pos]
        h = sched_tasks[pos].options[sched.choice[pos]].host
        u.sender = min((r for r in u.senders if host_of[r] == h), key=lambda r: (sent[r], r))
        sent[u.sender] += u.nbytes
    buckets = _buckets(pieces, dtypes, piece_bytes, strategy, host_of, net)
    steps, waves = _schedule(buckets, bucket_bytes)
    plan = TransferPlan(key=key, params=tuple(params), source=src, dest=dst, aliases=aliases,
                        replicas=tuple(r.name for r in replicas),
                        replica_ranks={r.name: tuple(sorted(r.boxes)) for r in replicas}, hosts=host_of,
                        strategy=strategy, scheduler=sched.scheduler if sched else scheduler,
                        bucket_bytes=bucket_bytes, streams=streams, pieces=pieces, piece_names=names, piece_dtypes=dtypes,
                        local_copies=local, buckets=buckets, num_steps=steps, num_waves=waves, network=net)
    if strat.chunks is not None:
        for b in buckets:
            for i, _ in b.entries:
                pieces[i].chunks = b.chunks
    return plan


def _buckets(pieces: list[UnitTask], dtypes: list[str], bucket_bytes: int, strategy: str,
             host_of: dict[int, int], net: NetworkModel) -> list[Bucket]:
    """Pieces grouped by (sender, remote receivers, dtype), packed in order into buckets of at most
    ``bucket_bytes`` (a piece larger than a bucket cannot exist: pieces were split to fit)."""
    routes: dict[tuple, list[int]] = {}
    for i, u in enumerate(pieces):
        held = set(u.senders)
        remote = tuple(r for r in u.receivers if r not in held)
        routes.setdefault((u.sender, remote, dtypes[i]), []).append(i)
    strat = get_strategy(strategy)
    out: list[Bucket] = []
    turns: dict[int, int] = {}
    heads: Counter[tuple[int, ...]] = Counter()
    for (sender, remote, dtype), idxs in routes.items():
        item = ITEMSIZE[dtype]
        total = sum(pieces[i].numel for i in idxs) * item
        target = total / -(-total // bucket_bytes)  # the route's bytes in as few buckets as fit, about equal
        cur: list[tuple[int, int]] = []
        off = 0
        groups = []
        for i in idxs:
            n = pieces[i].numel
            if cur and ((off + n) * item > bucket_bytes or off * item >= target):
                groups.append((cur, off))
                cur, off = [], 0
            cur.append((i, off))
            off += n
        if cur:
            groups.append((cur, off))
        for entries, numel in groups:
            recv = _rotate_hosts(rotate_receivers(sorted(remote), host_of, turns), host_of, heads)
            hosts = len({host_of[r] for r in recv} - {host_of[sender]})
            k = strat.chunks(net, numel * item, hosts, numel) if strat.chunks is not None else 1
            msgs = build_messages(strategy, numel, sender, list(recv), host_of, k)
            out.append(Bucket(len(out), dtype, sender, recv, entries, numel, k, msgs))
    return out


def _rotate_hosts(recv: Sequence[int], host_of: Mapping[int, int], heads: Counter) -> tuple[int, ...]:
    """``recv`` with its hosts rotated by the number of earlier buckets to the same hosts (``heads``, updated): the
    broadcast chain enters the receiving hosts in that order, so successive buckets start at successive hosts and
    the forwarding (and its NIC send side) is shared among them."""
    hosts = list(dict.fromkeys(host_of[r] for r in recv))
    k = heads[tuple(sorted(hosts))] % len(hosts) if hosts else 0
    heads[tuple(sorted(hosts))] += 1
    order = {h: i for i, h in enumerate(hosts[k:] + hosts[:k])}
    return tuple(sorted(recv, key=lambda r: order[host_of[r]]))


def _local_steps(b: Bucket) -> int:
    """Each message of ``b`` its step counted from the bucket's start (its chunk's turn on its (sender,
    receiver) pair; a forward one step after the message that brought its data); returns the bucket's length."""
    pair: Counter[tuple[int, int]] = Counter()
    got: dict[tuple[int, int, int], int] = {}  # (rank, start, stop) -> step its data arrived
    b.steps = []
    for m in b.msgs:
        if m.forward:
            src = next(s for (r, a, z), s in got.items() if r == m.src and a <= m.start and m.stop <= z)
            s = max(src + 1, pair[(m.src, m.dst)])
        else:
            s = pair[(m.src, m.dst)]
        pair[(m.src, m.dst)] = s + 1
        got[(m.dst, m.start, m.stop)] = s
        b.steps.append(s)
    return 1 + max(b.steps, default=-1)


def _nbytes(b: Bucket) -> int:
    return b.numel * ITEMSIZE[b.dtype]


def _staging(buckets: Sequence[Bucket]) -> dict[int, int]:
    """Per rank, the most bucket bytes staged at once, each bucket from the rank's first step on it to its last."""
    spans: dict[int, list[tuple[int, int, int]]] = {}
    for b in buckets:
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for m, st in zip(b.msgs, b.steps):
            for r in (m.src, m.dst):
                first[r] = min(first.get(r, st), st)
                last[r] = max(last.get(r, st), st)
        for r in first:
            spans.setdefault(r, []).append((first[r], last[r], _nbytes(b)))
    out: dict[int, int] = {}
    for r, sp in spans.items():
        events = sorted([(a, 0, n) for a, _, n in sp] + [(z, 1, -n) for _, z, n in sp])
        cur = top = 0
        for _, _, n in events:  # at one step: allocations first, then frees
            cur += n
            top = max(top, cur)
        out[r] = top
    return out


def _schedule(buckets: list[Bucket], budget: int) -> tuple[int, int]:
    """Every message its global step; returns (steps, waves).

    **Streams** when they fit: each route (sender, receivers) sends its buckets one after the other, every route
    from step 0 on — a route's next bucket leaves its sender the step after the sender's last message of the
    previous one, so it fills the chain while the previous one drains (no pipeline drains, packing and unpacking
    overlap the traffic). A rank then stages at most two buckets of each route it is in (checked exactly: the
    plan's staging must stay within ``budget``); where that does not fit, each bucket waits for the previous
    one's end (one bucket per route).
    **Waves** otherwise: the k-th bucket of every route before the (k+1)-th of any, each in the first wave after
    its route's previous bucket where every participant's staged bytes stay within ``budget``; a wave starts
    when the previous one has ended. ``Bucket.wave`` is the bucket's index in its route (streams) or its wave."""
    routes: dict[tuple, list[Bucket]] = {}
    for b in buckets:
        routes.setdefault((b.sender, frozenset(b.receivers)), []).append(b)
    length = {b.index: _local_steps(b) for b in buckets}
    need: Counter[int] = Counter()
    for bs in routes.values():
        top = max(_nbytes(b) for b in bs)
        for r in {bs[0].sender, *bs[0].receivers}:
            need[r] += top
    local = {b.index: list(b.steps) for b in buckets}
    for overlap in (True, False):
        if need and max(need.values()) * (2 if overlap else 1) > budget:
            continue
        end = 0
        for bs in routes.values():
            base = 0
            for k, b in enumerate(bs):
                b.wave, b.steps = k, [base + s for s in local[b.index]]
                end = max(end, base + length[b.index])
                if overlap:  # the next bucket leaves the sender right after this one; it fills as this one drains
                    base = 1 + max((s for m, s in zip(b.msgs, b.steps) if m.src == b.sender), default=base)
                else:
                    base += length[b.index]
        if not need or max(_staging(buckets).values()) <= budget:
            return end, max((len(bs) for bs in routes.values()), default=0)
    for b in buckets:
        b.steps = list(local[b.index])
    turn = {b.index: k for bs in routes.values() for k, b in enumerate(bs)}
    used: list[Counter[int]] = []
    after: dict[tuple, int] = {}  # route -> the wave of its previous bucket (one bucket of a route per wave)
    for b in sorted(buckets, key=lambda b: (turn[b.index], b.index)):
        ranks = {b.sender, *b.receivers}
        route = (b.sender, frozenset(b.receivers))
        nb = _nbytes(b)
        w = next((i for i in range(after.get(route, -1) + 1, len(used))
                  if all(used[i][r] + nb <= budget for r in ranks)), len(used))
        if w == len(used):
            used.append(Counter())
        for r in ranks:
            used[w][r] += nb
        b.wave = after[route] = w
    lengths = [0] * len(used)
    for b in buckets:
        lengths[b.wave] = max(lengths[b.wave], length[b.index])
    base = [sum(lengths[:w]) for w in range(len(used))]
    for b in buckets:
        b.steps = [base[b.wave] + s for s in b.steps]
    return sum(lengths), len(used)
