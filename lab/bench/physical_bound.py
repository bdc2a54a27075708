"""The physical bound of a pipeline configuration: what no schedule, runtime or strategy could beat on the
emulated cluster with the configuration's compute, bytes and dependencies (pure: no processes, no torch).

The signal bound (the same schedule with 1-byte transfers) ignores what no schedule can hide: the first
activation has to cross every stage boundary before the last stage starts, and the last gradient back again,
and a NIC moves its bytes no faster than its rate. The physical bound of a configuration is the largest of

* **compute** — every rank's compute: per mesh, the sum of its program's F/B/I/W at their (paced) costs;
* **NIC** — every NIC side's bytes ÷ its rate: per host and direction, the bytes the configuration's
  resharding plans put on that side (activations and gradients of every edge, every microbatch), less the
  token bucket's burst (the emulator's ``tc tbf`` lets ``burst`` bytes through at once, then ``rate``: at most
  burst + rate·T bytes in any T), over the nominal rate;
* **critical path** — the fill and drain, an explicit formula over the chain of stages (whatever the schedule
  orders; `critical_path_ms`): no stage computes before the first activation has come through every stage
  before it (``head_s`` = Σ F and forward transfers before s), and after a stage's last input gradient the
  gradient still has to go back through every stage before it (``tail_s`` = Σ backward transfers and input
  gradients before s, then stage 0's last weight gradient when W is split off). A stage on a mesh of its
  own: head_s + m·(F_s + B_s) + tail_s with delayed W counted after the tail (B_s = I_s then), and head_s +
  all of its compute; a mesh holding several stages (virtual stages): its earliest head + all of its compute;
  and one microbatch's round trip (every F, transfer and B). A transfer takes its wire time: the busiest NIC
  side's bytes of it, less one burst, over the rate.

Each term is a lower bound of the measured step of any schedule of the configuration (its strategy's bytes,
its delayed-W setting, its compute budgets): compute actions take at least their paced budgets, transfers at
least their wire time, a NIC side carries at least those bytes. So the largest is too; a measurement faster
than it is void. ``fraction`` = bound / measured (1 = physically perfect); ``gap_closure`` against it =
(t_baseline − t) / (t_baseline − bound).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

__all__ = ["PhysicalBound", "physical_bound", "compute_per_mesh", "critical_path_ms", "nic_ms", "wire_ms",
           "uniform_side_bytes", "fill", "TBF_BURST_BYTES", "refill_s"]

TBF_BURST_BYTES = 256 * 1024
"""The emulated NICs' token bucket (``lab/cluster/emulate_cluster.py``: ``tc tbf ... burst 256kb``; tc reads
``kb`` as kilobytes — ``tc qdisc show`` prints it back as ``burst 256Kb``, and ``256kbit`` as ``32Kb`` — so a
NIC idle long enough passes 256 KiB at once: a 64 KiB activation at 10 Mbit/s crosses in no rate-limited time)."""


@dataclass(frozen=True)
class PhysicalBound:
    compute_ms: float
    nic_ms: float
    critical_path_ms: float
    busiest_side: str  # the NIC side of nic_ms ("h1 out")
    busiest_mesh: int  # the mesh of compute_ms
    free_transfers_ms: float = 0.0  # the bound if every transfer were free (compute and the compute fill-drain)

    @property
    def bound_ms(self) -> float:
        return max(self.compute_ms, self.nic_ms, self.critical_path_ms)

    @property
    def binding(self) -> str:
        """Which term is the bound: "compute", "NIC (h1 out)" or "critical path"."""
        terms = {"compute": self.compute_ms, f"NIC ({self.busiest_side})": self.nic_ms,
                 "critical path": self.critical_path_ms}
        return max(terms, key=lambda k: terms[k])

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "bound_ms": round(self.bound_ms, 3), "binding": self.binding}


def compute_per_mesh(schedule: Any, costs: Any) -> list[float]:
    """Per mesh: the sum of its program's compute actions at `costs` (a `Costs`)."""
    return [sum(costs.compute(a.kind, a.stage) for a in acts if a.kind.is_compute) for acts in schedule.actions]


def nic_ms(side_bytes_per_mb: Mapping[str, float], microbatches: int, gbps: float,
           burst_bytes: float = TBF_BURST_BYTES) -> tuple[float, str]:
    """The busiest NIC side over a step: (ms, side) — (bytes × microbatches − burst) / rate."""
    if not side_bytes_per_mb:
        return 0.0, "-"
    side = max(side_bytes_per_mb, key=lambda k: side_bytes_per_mb[k])
    b = side_bytes_per_mb[side] * microbatches
    return max(0.0, b - burst_bytes) * 8 / (gbps * 1e9) * 1e3, side


def wire_ms(nbytes: float, gbps: float, burst_bytes: float = TBF_BURST_BYTES) -> float:
    """The least time one transfer of `nbytes` (its busiest NIC side) takes: a burst at once, the rest at rate."""
    return max(0.0, nbytes - burst_bytes) * 8 / (gbps * 1e9) * 1e3


def refill_s(gbps: float, burst_bytes: float = TBF_BURST_BYTES) -> float:
    """Seconds an idle NIC takes to refill its token bucket: every participant of a benchmark waits this long
    (with a tenth more) after the barrier that starts its step, so that each starts with full buckets, as the
    bound assumes. Without it a participant that follows one whose last transfers emptied the buckets starts
    up to a burst behind one that follows a participant sending placeholder bytes (the signal bound)."""
    return 1.1 * burst_bytes * 8 / (gbps * 1e9)


def critical_path_ms(schedule: Any, costs: Any, wire: Mapping[str, float], microbatches: int) -> float:
    """The fill-and-drain term (module docstring) for `schedule`'s graph and placement: `costs` a `Costs`
    (F/B/I/W per stage), `wire` ms of one transfer per edge text; delayed W when the schedule has W actions."""
    g, place, m = schedule.graph, schedule.placement or tuple(range(schedule.graph.num_stages)), microbatches
    split = any(a.kind.value == "W" for acts in schedule.actions for a in acts)
    n = g.num_stages
    chain = {e.src: e for e in g.edges if e.is_chain}
    f = [costs.compute(_kind("F"), s) for s in range(n)]
    i = [costs.compute(_kind("I" if split else "B"), s) for s in range(n)]
    w = [costs.compute(_kind("W"), s) if split else 0.0 for s in range(n)]
    hop = [0.0 if place[s] == place[s + 1] else wire.get(str(chain[s]), 0.0) for s in range(n - 1)]
    head = [sum(f[k] + hop[k] for k in range(s)) for s in range(n)]
    tail = [sum(hop[k] + i[k] for k in range(s)) + w[0] for s in range(n)]
    best = sum(f) + sum(i) + 2 * sum(hop) + w[0]  # one microbatch's round trip
    for mesh in sorted(set(place)):
        stages = [s for s in range(n) if place[s] == mesh]
        total = m * sum(f[s] + i[s] + w[s] for s in stages)
        best = max(best, min(head[s] for s in stages) + total)
        if len(stages) == 1:
            (s,) = stages
            best = max(best, head[s] + m * (f[s] + i[s]) + tail[s])
    return best


def _kind(k: str) -> Any:
    from megareshard.pipeline import ActionKind

    return ActionKind(k)


def physical_bound(schedule: Any, costs: Any, wire_bytes: Mapping[str, float], side_bytes_per_mb: Mapping[str, float],
                   microbatches: int, gbps: float, burst_bytes: float = TBF_BURST_BYTES) -> PhysicalBound:
    """The bound of one configuration: `schedule` one of its schedules (its graph, placement, delayed W and
    compute actions — the order does not matter), `costs` a `megareshard.pipeline.Costs` with its compute,
    `wire_bytes` per edge text the busiest NIC side's bytes of one transfer (the smaller direction; 0 for a
    local hand-off; ``"*"`` for every edge not named), `side_bytes_per_mb` per NIC side ("h1 out") the bytes of one microbatch, `gbps` the
    nominal NIC rate."""
    per_mesh = compute_per_mesh(schedule, costs)
    mesh = max(range(len(per_mesh)), key=lambda m: per_mesh[m])
    nic, side = nic_ms(side_bytes_per_mb, microbatches, gbps, burst_bytes)
    wire = {str(e): wire_ms(wire_bytes.get(str(e), wire_bytes.get("*", 0.0)), gbps, burst_bytes)
            for e in schedule.graph.edges}
    path = critical_path_ms(schedule, costs, wire, microbatches)
    free = max(per_mesh[mesh], critical_path_ms(schedule, costs, {}, microbatches))
    return PhysicalBound(round(per_mesh[mesh], 3), round(nic, 3), round(path, 3), side, mesh, round(free, 3))


def uniform_side_bytes(schedule: Any, out_bytes: float, in_bytes: float) -> dict[str, float]:
    """Per NIC side, one microbatch's bytes when every stage boundary carries the same tensor and each mesh is
    one host (uniform layouts, as the peers grid runs): each cross-mesh edge puts `out_bytes` on its sending
    mesh's out side and `in_bytes` on the receiving one's in side, activation and gradient alike."""
    place = schedule.placement or tuple(range(schedule.graph.num_stages))
    side: dict[str, float] = {}
    for e in schedule.graph.edges:
        a, b = place[e.src], place[e.dst]
        if a == b:
            continue
        for src, dst in ((a, b), (b, a)):
            side[f"h{src} out"] = side.get(f"h{src} out", 0.0) + out_bytes
            side[f"h{dst} in"] = side.get(f"h{dst} in", 0.0) + in_bytes
    return side


def fraction(bound_ms: float | None, ms: float | None) -> float | None:
    """bound / measured: the share of the physically reachable speed a measurement achieves."""
    if bound_ms is None or not ms:
        return None
    return bound_ms / ms


def gap_closure(t_baseline: float | None, t: float, bound_ms: float | None) -> float | None:
    """(t_baseline − t) / (t_baseline − bound): the share of the baseline's distance to this configuration's
    physical bound that the configuration wins back; None without a positive gap."""
    if t_baseline is None or bound_ms is None or t_baseline - bound_ms <= 0:
        return None
    return (t_baseline - t) / (t_baseline - bound_ms)


def fill(records: Sequence[dict[str, Any]], baseline: str, key_ms: str = "ms_per_iter",
         name: str = "config") -> None:
    """Per record with a ``physical`` bound: ``physical_fraction``, ``physical_gap_closure`` (not for the
    baseline itself nor a ``signal`` run) and ``physical_void`` (measured faster than the bound)."""
    by = {r[name]: r for r in records}
    base = by.get(baseline)
    for r in records:
        if r.get("strategy") == "signal":
            r.update(physical_fraction=None, physical_gap_closure=None, physical_void=False)
            continue
        pb = (r.get("physical") or {}).get("bound_ms")
        ms = r.get(key_ms)
        r["physical_fraction"] = fraction(pb, ms)
        r["physical_gap_closure"] = gap_closure(base.get(key_ms) if base else None, ms, pb) \
            if ms is not None and r is not base else None
        r["physical_void"] = bool(pb is not None and ms is not None and ms < pb)
