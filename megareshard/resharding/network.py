"""Host-level network model: one full-duplex NIC per host plus a fast intra-host link.

`task_cost` asks the task's registered strategy (`strategies/`, paper §3.1) what the task does to the NICs;
the schedulers use it (in bytes) to balance load, and `NetworkModel` uses it (in seconds) to predict a
plan's time and its lower bound.

Model, kept deliberately simple so predictions can be compared with measurements:
* a task occupies, for its whole duration, the send side of every host that sends for it
  and the receive side of every host that receives for it; a NIC side serves one task at
  a time; tasks are list-scheduled in plan order (each starts once every NIC side it
  needs is free);
* durations: t = bytes / NIC bandwidth, t_intra = bytes / intra-host bandwidth
  - sendrecv:  (remote receiver ranks)·t + (local receiver ranks)·t_intra
  - allgather: (remote receiving hosts)·t + t_intra if any host fans out to >1 device
  - broadcast: max(t·(1 + (A-1)/K), t_intra·(1 + (hops-1)/K)), pipelined in K chunks along
    the chain, hops = A (+1 when some host fans the slice out to more devices)
  plus a fixed `latency_s` per task;
* that is the executor's ``order="plan"``; for ``order="concurrent"`` (every task at once, TCP
  sharing each NIC side) `predict` takes the busiest NIC side's bytes instead (see there);
* a task whose receivers all sit on the sender's host uses no NIC; such intra-host
  copies are serialised per host on an "intra" resource.

Broadcast chunk count K (`NetworkModel.broadcast_chunks`): the model's one source of
truth, chosen per task and stored on the plan's task (`UnitTask.chunks`), which the
executor reads. A chain through A receiving hosts in K chunks of c/K seconds each, every
message also paying a fixed overhead o (`message_overhead_s`), takes
(K + A - 1)·(c/K + o) = c·(1 + (A-1)/K) + (K + A - 1)·o: more chunks shrink the pipeline
fill (A-1)/K and add messages. The minimum is at K* = sqrt((A-1)·c / o), rounded to the
better neighbouring integer, at least 1 (one receiving host or a tiny slice: K = 1), at
most the slice's elements and `MAX_BROADCAST_CHUNKS`. The time predictions count the
fill, not the overhead (`latency_s` covers fixed costs per task).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import combinations
from typing import TYPE_CHECKING, Protocol

from .strategies import get_strategy
from .wire import INTRA, RECV, SEND, TaskCost

if TYPE_CHECKING:  # pragma: no cover
    from .decompose import UnitTask


DEFAULT_NIC_GBPS = 1.0  # the planner's NIC rate when none is given (that of the emulated cluster)
# Per-message cost of a point-to-point send (post, match, TCP round of gloo; kernel launch and
# protocol step of NCCL): of the order of 10-100 µs, the middle taken.
DEFAULT_MESSAGE_OVERHEAD_S = 50e-6
MAX_BROADCAST_CHUNKS = 64  # bounds the messages of one broadcast chain per pair of ranks


def check_strategy(strategy: str) -> str:
    """`strategy` if it is registered (`strategies/`), else a ValueError with the registered names."""
    get_strategy(strategy)
    return strategy


def task_cost(
    strategy: str,
    nbytes: int,
    sender_host: int,
    receivers_per_host: Mapping[int, int],
    chunks: int = 16,
) -> TaskCost:
    """Cost of sending one slice of `nbytes` from `sender_host` to the receivers, as the registered `strategy`
    costs it (`strategies/`).

    `receivers_per_host` maps each host to its number of receiving ranks that need the
    data moved (not those already holding it); receivers on the sender's host are
    served by intra-host copies.
    """
    return get_strategy(strategy).cost(nbytes, sender_host, receivers_per_host, chunks)


class PlanView(Protocol):
    """What the network model reads of a resharding plan (`plan.ReshardingPlan`, which builds one with this
    model: a protocol here keeps the import one way)."""

    strategy: str
    tasks: list["UnitTask"]

    def task_cost(self, task: "UnitTask") -> TaskCost: ...

    def sender_host(self, task: "UnitTask") -> int: ...

    def host_of(self, rank: int) -> int: ...


class NetworkModel:
    """Hosts with one full-duplex NIC each (`nic_gbps` each way) and `intra_gbps` inside."""

    def __init__(self, nic_gbps: float = DEFAULT_NIC_GBPS, intra_gbps: float = 100.0, *, latency_s: float = 0.0,
                 message_overhead_s: float = DEFAULT_MESSAGE_OVERHEAD_S) -> None:
        if nic_gbps <= 0 or intra_gbps <= 0:
            raise ValueError(f"bandwidths must be > 0, got nic {nic_gbps} Gbit/s, intra {intra_gbps} Gbit/s")
        if latency_s < 0:
            raise ValueError(f"latency must be >= 0, got {latency_s}")
        if message_overhead_s <= 0:
            raise ValueError(f"message_overhead_s must be > 0, got {message_overhead_s}")
        self.nic_gbps = float(nic_gbps)
        self.intra_gbps = float(intra_gbps)
        self.latency_s = float(latency_s)
        self.message_overhead_s = float(message_overhead_s)

    def broadcast_chunks(self, nbytes: int, hosts: int, numel: int) -> int:
        """K for a pipelined broadcast of `nbytes` (`numel` elements) along a chain through
        `hosts` receiving hosts (A in the module docstring).

        Minimises c·(1 + (A-1)/K) + (K + A - 1)·o, c = nbytes / NIC bandwidth, o the
        per-message overhead: the smallest K >= 1 with K·(K+1) >= (A-1)·c/o (K* = sqrt of
        that, to an integer), clamped to [1, min(numel, MAX_BROADCAST_CHUNKS)]. Non-decreasing
        in `nbytes` and in `hosts`; 1 for one receiving host or a slice too small to split.
        """
        if hosts <= 1 or numel <= 1 or nbytes <= 0:
            return 1
        x = (hosts - 1) * (nbytes / self.nic_Bps) / self.message_overhead_s
        cap = min(numel, MAX_BROADCAST_CHUNKS)
        k = max(1, int(x ** 0.5))
        while k > 1 and (k - 1) * k >= x:  # float rounding of the square root
            k -= 1
        while k < cap and k * (k + 1) < x:
            k += 1
        return min(k, cap)

    @property
    def nic_Bps(self) -> float:
        return self.nic_gbps * 1e9 / 8

    @property
    def intra_Bps(self) -> float:
        return self.intra_gbps * 1e9 / 8

    def task_times(self, plan: "PlanView") -> list[tuple[float, float]]:
        """(start, end) seconds of each task of `plan.tasks`, by list scheduling in plan order."""
        free: dict[tuple[int, int], float] = {}
        out = []
        for task in plan.tasks:
            cost = plan.task_cost(task)
            res = cost.resources(plan.sender_host(task))
            start = max((free.get(r, 0.0) for r in res), default=0.0)
            end = start + cost.seconds(self.nic_Bps, self.intra_Bps, self.latency_s)
            for r in res:
                free[r] = end
            out.append((start, end))
        return out

    def predict(self, plan: "PlanView", order: str = "plan", tasks: Sequence["UnitTask"] | None = None) -> float:
        """Predicted seconds for the plan under its strategy and the executor's `order`.

        ``"plan"``: list scheduling in plan order, one task per NIC side at a time (module
        docstring). ``"concurrent"``: every task on the wire at once and each NIC side shared
        among its flows (TCP): the busiest side's bytes / bandwidth, or the slowest single
        task alone (its pipeline fill, intra-host part), or a host's serialised intra-host-only
        tasks, whichever is longest. The sender choice matters, the order does not; the
        prediction lies between `lower_bound` and the "plan" prediction. `tasks` (concurrent only): a subset
        of the plan's tasks on the wire alone (default: all of them).
        """
        if order == "plan":
            return max((end for _, end in self.task_times(plan)), default=0.0)
        if order != "concurrent":
            raise ValueError(f"order must be 'plan' or 'concurrent', got {order!r}")
        tasks = plan.tasks if tasks is None else tasks
        if not tasks:
            return 0.0
        busiest = max((max(o, i) for o, i in self.host_bytes(plan, tasks).values()), default=0)
        alone = 0.0
        intra: dict[int, float] = {}
        for task in tasks:
            cost = plan.task_cost(task)
            t = cost.seconds(self.nic_Bps, self.intra_Bps, self.latency_s)
            alone = max(alone, t)
            if not cost.out_bytes and not cost.in_bytes:  # no NIC: the host's intra resource
                h = plan.sender_host(task)
                intra[h] = intra.get(h, 0.0) + t
        return max(busiest / self.nic_Bps + self.latency_s, alone, max(intra.values(), default=0.0))

    def host_bytes(self, plan: "PlanView",
                   tasks: Sequence["UnitTask"] | None = None) -> dict[int, tuple[int, int]]:
        """Per host: (bytes out of, bytes into) its NIC under the plan's strategy and senders (of `tasks`, a
        subset of the plan's; default all)."""
        acc: dict[int, list[int]] = {}
        for task in plan.tasks if tasks is None else tasks:
            cost = plan.task_cost(task)
            for h, b in cost.out_bytes.items():
                acc.setdefault(h, [0, 0])[0] += b
            for h, b in cost.in_bytes.items():
                acc.setdefault(h, [0, 0])[1] += b
        return {h: (o, i) for h, (o, i) in sorted(acc.items())}

    def lower_bound(self, plan: "PlanView") -> float:
        """max over hosts of max(bytes in, bytes out) / NIC bandwidth, whatever the schedule.

        In: every receiving host that holds no copy of a slice must receive it once.
        Out: a slice that some receiving host lacks must leave one of its source hosts;
        for any set H of source hosts, the busiest host of H sends at least
        (bytes of slices whose sources all lie in H) / |H|. Under `signal` a task counts
        as 1 byte, so the bound stays below the prediction for every strategy.
        """
        bytes_in: dict[int, int] = {}
        forced: dict[frozenset[int], int] = {}
        wire = get_strategy(plan.strategy).wire_bytes or (lambda n: n)
        for task in plan.tasks:
            b = wire(task.nbytes)
            src_hosts = frozenset(plan.host_of(r) for r in task.senders)
            needy = {plan.host_of(r) for r in task.receivers} - src_hosts
            for h in needy:
                bytes_in[h] = bytes_in.get(h, 0) + b
            if needy:
                forced[src_hosts] = forced.get(src_hosts, 0) + b
        best = max(bytes_in.values(), default=0)
        universe = sorted(set().union(*forced)) if forced else []
        if len(universe) <= 12:
            groups = [frozenset(c) for k in range(1, len(universe) + 1) for c in combinations(universe, k)]
        else:
            groups = [frozenset([h]) for h in universe] + list(forced) + [frozenset(universe)]
        for g in groups:
            total = sum(b for s, b in forced.items() if s <= g)
            best = max(best, total / len(g))
        return best / self.nic_Bps
