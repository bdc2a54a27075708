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
* **critical path** — the fill and drain: the configuration's own schedule in the simulator with its compute
  costs and every transfer at its wire time (the busiest NIC side's bytes of that transfer, less one burst,
  over the rate), but no NIC sharing (``Costs(nic_sharing=False)``: a transfer starts the moment it is ready,
  however many others are in flight). That is the schedule's longest chain of compute and transfers that
  must run one after the other — derived from the simulator, not a formula.

Each term is a lower bound of the measured step of the configuration (the runtime runs the same programs, each
compute action takes at least its paced budget, each transfer at least its wire time, each NIC side carries
at least those bytes), so the largest is too. A measurement faster than it is void. ``fraction`` = bound /
measured (1 = physically perfect); ``gap_closure`` against it = (t_baseline − t) / (t_baseline − bound).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

__all__ = ["PhysicalBound", "physical_bound", "compute_per_mesh", "nic_ms", "wire_ms", "TBF_BURST_BYTES"]

TBF_BURST_BYTES = 256 * 1000 // 8
"""The emulated NICs' token bucket (``lab/cluster/emulate_cluster.py``: ``tc tbf ... burst 256kb`` = 256 kbit)."""


@dataclass(frozen=True)
class PhysicalBound:
    compute_ms: float
    nic_ms: float
    critical_path_ms: float
    busiest_side: str  # the NIC side of nic_ms ("h1 out")
    busiest_mesh: int  # the mesh of compute_ms

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


def physical_bound(schedule: Any, costs: Any, wire_bytes: Mapping[str, float], side_bytes_per_mb: Mapping[str, float],
                   microbatches: int, gbps: float, burst_bytes: float = TBF_BURST_BYTES) -> PhysicalBound:
    """The bound of one configuration: `schedule` its compute-only schedule (the registry's or a peer's compute
    order), `costs` a `megareshard.pipeline.Costs` with its compute (comm ignored), `wire_bytes` per edge text
    the busiest NIC side's bytes of one transfer (the smaller direction; 0 for a local hand-off),
    `side_bytes_per_mb` per NIC side ("h1 out") the bytes of one microbatch, `gbps` the nominal NIC rate."""
    from dataclasses import replace

    from megareshard.pipeline import simulate

    per_mesh = compute_per_mesh(schedule, costs)
    mesh = max(range(len(per_mesh)), key=lambda m: per_mesh[m])
    nic, side = nic_ms(side_bytes_per_mb, microbatches, gbps, burst_bytes)
    comm = {str(e): wire_ms(wire_bytes.get(str(e), 0.0), gbps, burst_bytes) for e in schedule.graph.edges}
    path = simulate(schedule, costs=replace(costs, comm=comm, nic_sharing=False, rendezvous=False)).makespan
    return PhysicalBound(round(per_mesh[mesh], 3), round(nic, 3), round(path, 3), side, mesh)


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
