"""Plan a cross-mesh resharding: decompose, cost each task per strategy, schedule.

Pure data, no processes: the executor turns a `ReshardingPlan` into communication, the
network model predicts its time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from .decompose import UnitTask, decompose
from .mesh import Mesh
from .network import NetworkModel, task_cost
from .strategies import get_strategy
from .wire import INTRA, RECV, SEND, TaskCost
from .schedulers import Option, SchedTask, check_order, get_scheduler, run_scheduler, schedule_cost
from .spec import ShardingSpec

__all__ = ["UnitTask", "ReshardingPlan", "plan_resharding"]


def _fmt_slice(sl: tuple[slice, ...]) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in sl) + "]"


def _fmt_ranks(ranks: Sequence[int]) -> str:
    rs = list(ranks)
    if len(rs) > 2 and rs == list(range(rs[0], rs[-1] + 1)):
        return f"{rs[0]}-{rs[-1]}"
    return ",".join(map(str, rs))


@dataclass
class ReshardingPlan:
    shape: tuple[int, ...]
    src_mesh: Mesh
    src_spec: ShardingSpec
    dst_mesh: Mesh
    dst_spec: ShardingSpec
    strategy: str  # a registered strategy's name (`strategies/`)
    scheduler: str  # the scheduler actually used: naive, loadbalance, dfs, greedy
    itemsize: int
    tasks: list[UnitTask]  # in execution order, each with .sender set
    rounds: list[list[int]]  # UnitTask.index grouped; concatenation == order of .tasks
    optimal: bool  # True when the scheduler's search finished (its objective is optimal)
    order: str = "concurrent"  # the executor order the schedule was optimised for (`auto`)
    makespan_bytes: float = 0.0  # list-scheduling makespan in plan order, in bytes over one NIC
    cost_bytes: float = 0.0  # the objective under `order`, in bytes over one NIC
    _costs: dict[int, TaskCost] = field(default_factory=dict, repr=False, compare=False)

    # --- host views the executor and network model share ------------------------------
    def host_of(self, rank: int) -> int:
        if rank in self.src_mesh:
            return self.src_mesh.host_of(rank)
        return self.dst_mesh.host_of(rank)

    def sender_host(self, task: UnitTask) -> int:
        if task.sender is None:
            raise ValueError(f"task {task.index} has no sender chosen")
        return self.host_of(task.sender)

    def receivers_by_host(self, task: UnitTask) -> dict[int, tuple[int, ...]]:
        """Receiver ranks grouped by host (hosts ascending)."""
        out: dict[int, list[int]] = {}
        for r in task.receivers:
            out.setdefault(self.host_of(r), []).append(r)
        return {h: tuple(rs) for h, rs in sorted(out.items())}

    def wire_counts(self, task: UnitTask) -> dict[int, int]:
        """Per host, the receivers that need the data moved to them: a receiver that is
        also a source rank of the slice copies from its own source shard (as the
        executor does) and costs nothing."""
        held = set(task.senders)
        out: dict[int, int] = {}
        for r in task.receivers:
            if r not in held:
                h = self.host_of(r)
                out[h] = out.get(h, 0) + 1
        return dict(sorted(out.items()))

    def remote_hosts(self, task: UnitTask) -> tuple[int, ...]:
        """Hosts the slice crosses a NIC to, ascending: the broadcast chain order."""
        sh = self.sender_host(task)
        return tuple(h for h in self.wire_counts(task) if h != sh)

    def task_cost(self, task: UnitTask) -> TaskCost:
        """NIC/intra cost of `task` under the plan's strategy (cached: set senders first)."""
        cost = self._costs.get(task.index)
        if cost is None:
            counts = self.wire_counts(task)
            cost = task_cost(self.strategy, task.nbytes, self.sender_host(task), counts, task.chunks)
            self._costs[task.index] = cost
        return cost

    def round_of(self) -> dict[int, int]:
        """UnitTask.index -> round number."""
        return {t: k for k, rnd in enumerate(self.rounds) for t in rnd}

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tasks)

    def __str__(self) -> str:
        head = (
            f"resharding {tuple(self.shape)} x{self.itemsize}B: {self.src_mesh} {self.src_spec} "
            f"-> {self.dst_mesh} {self.dst_spec}; strategy={self.strategy} scheduler={self.scheduler}"
            f"{' (optimal)' if self.optimal else ''} for order={self.order}; "
            f"{len(self.tasks)} tasks in {len(self.rounds)} rounds"
        )
        rnd = self.round_of()
        rows = [("task", "slice", "senders", "receivers", "sender@host", "bytes", "chunks", "round")]
        for t in self.tasks:
            rows.append((
                str(t.index), _fmt_slice(t.slice), _fmt_ranks(t.senders), _fmt_ranks(t.receivers),
                f"{t.sender}@{self.sender_host(t)}", str(t.nbytes), str(t.chunks), str(rnd[t.index]),
            ))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = [head] + ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines)


def _check_meshes(src: Mesh, dst: Mesh) -> None:
    for r in set(src.flat_ranks) & set(dst.flat_ranks):
        if src.host_of(r) != dst.host_of(r):
            raise ValueError(
                f"rank {r} is on host {src.host_of(r)} in the source mesh but on host "
                f"{dst.host_of(r)} in the destination mesh"
            )


def plan_resharding(
    shape: Sequence[int],
    src_mesh: Mesh,
    src_spec: ShardingSpec,
    dst_mesh: Mesh,
    dst_spec: ShardingSpec,
    strategy: str = "broadcast",
    scheduler: str = "auto",
    itemsize: int = 4,
    *,
    order: str = "concurrent",
    time_budget_s: float = 1.0,
    seed: int = 0,
    broadcast_chunks: int | None = None,
    network: NetworkModel | None = None,
) -> ReshardingPlan:
    """Decompose, then choose one sending host per task and an order (see schedulers).

    `order` is the executor order the plan will run under ("concurrent", the executor's
    and the pipeline's default, or "plan"): `auto` minimises that order's cost. Each task's
    chunk count (`UnitTask.chunks`, what the executor sends) under a chunked strategy (broadcast) is
    `broadcast_chunks` when given (at most the slice's elements), else the strategy's choice for the task's size
    and receiving hosts (`network.broadcast_chunks` for broadcast; default network: `NetworkModel()`); under
    other strategies it is 1.

    Scheduling is at host granularity, in bytes over one NIC (uniform NIC bandwidth is
    assumed, so bytes order schedules as time does); the concrete sender is, in execution order, the
    chosen host's holder that sends the fewest bytes so far (ties: the lowest rank).
    """
    strat = get_strategy(strategy)
    get_scheduler(scheduler)
    check_order(order)
    if itemsize < 1:
        raise ValueError(f"itemsize must be >= 1 byte, got {itemsize}")
    if broadcast_chunks is not None and (int(broadcast_chunks) != broadcast_chunks or broadcast_chunks < 1):
        raise ValueError(f"broadcast_chunks must be an integer >= 1 or None (the network model's choice), "
                         f"got {broadcast_chunks!r}")
    net = network if network is not None else NetworkModel()
    shp = src_spec.check(shape)
    dst_spec.check(shp)
    _check_meshes(src_mesh, dst_mesh)
    tasks = decompose(shp, src_mesh, src_spec, dst_mesh, dst_spec, itemsize)

    def host(r: int) -> int:
        return src_mesh.host_of(r) if r in src_mesh else dst_mesh.host_of(r)

    # the scheduler sees NIC sides only: intra-host copies never wait for a NIC
    sched_tasks = []
    for t in tasks:
        held = set(t.senders)
        counts = Counter(host(r) for r in t.receivers if r not in held)
        cand = sorted({src_mesh.host_of(r) for r in t.senders})
        if strat.chunks is not None:  # a pipelined strategy: K chunks per task
            if broadcast_chunks is not None:
                t.chunks = min(int(broadcast_chunks), max(1, t.numel))  # the executor sends no empty chunk
            else:  # receiving hosts: the same for every candidate sender unless one of them receives
                hosts = max(sum(1 for x, c in counts.items() if x != h and c > 0) for h in cand)
                t.chunks = strat.chunks(net, t.nbytes, hosts, t.numel)
        opts = []
        for h in cand:
            cost = task_cost(strategy, t.nbytes, h, counts, t.chunks)
            loads = tuple([((x, SEND), float(b)) for x, b in sorted(cost.out_bytes.items())]
                          + [((x, RECV), float(b)) for x, b in sorted(cost.in_bytes.items())])
            opts.append(Option(h, cost.nic_bytes, frozenset((x, d) for x, d in cost.resources(h) if d != INTRA),
                               loads))
        sched_tasks.append(SchedTask(tuple(opts), naive=cand.index(src_mesh.host_of(t.senders[0]))))
    sched = run_scheduler(scheduler, sched_tasks, order=order, time_budget_s=time_budget_s, seed=seed)
    sent: Counter[int] = Counter()  # bytes each source rank sends, in execution order
    for pos in sched.order:
        t = tasks[pos]
        h = sched_tasks[pos].options[sched.choice[pos]].host
        # the host's holder that sends least so far (ties: the lowest rank): a host's tasks leave from all of its
        # devices, not all from its first one (one process, one progress thread, doing every send of the host)
        t.sender = min((r for r in t.senders if src_mesh.host_of(r) == h), key=lambda r: (sent[r], r))
        sent[t.sender] += t.nbytes
    return ReshardingPlan(
        shape=shp,
        src_mesh=src_mesh,
        src_spec=src_spec,
        dst_mesh=dst_mesh,
        dst_spec=dst_spec,
        strategy=strategy,
        scheduler=sched.scheduler,
        itemsize=itemsize,
        tasks=[tasks[p] for p in sched.order],
        rounds=[[tasks[p].index for p in rnd] for rnd in sched.rounds],
        optimal=sched.optimal,
        order=order,
        makespan_bytes=sched.makespan,
        cost_bytes=schedule_cost(sched_tasks, sched, order),
    )
