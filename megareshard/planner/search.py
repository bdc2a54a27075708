"""Search: enumerate layouts, prune by memory, pre-rank analytically, score the best by simulation (pure).

Candidates: tp (a divisor of the devices per host that divides the heads and key/value
groups: tp stays inside a host, placed innermost; dp and pp follow by communication volume), pp (a divisor of the layers), dp = world / (tp·pp), the
micro batch (the global batch must split into micro batch × dp), every schedule of the
registry with and without delayed weight gradients where that means something, every
executable resharding strategy, sequence parallelism when tp > 1, full recomputation on
or off, ZeRO 0/1/2. Ranks are placed by communication volume (tp innermost, as the
trainer does), so each stage's mesh and hosts follow from the topology.

1. **Memory** prunes first: a candidate whose stage needs more than the device holds (static
   state + live microbatches × activations + logits, `costs.py`) is dropped, with the reason
   counted.
2. **Pre-rank**: ``(m + P − 1)·max_stage(F + B)`` against the NIC-bound ``2·m·t_edge`` (every
   stage sends m activations and m gradients), plus the exposed data-parallel reduction.
3. **Score**: the best few layouts (every schedule × strategy × delayed W of each) run through
   the pipeline simulator with the per-stage F/B times and the resharding planner's
   predicted transfer time per edge; long runs are extrapolated from steady-state
   simulations (the step grows linearly in m once every stage is in its steady phase; two
   equal increments are required, otherwise the whole run is simulated).
   The data-parallel reduction of a stage starts after its last backward; what does not fit
   before the step's end is added.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..parallel import CommVolume, Topology, hosts_spanned
from ..pipeline.generators import RUNTIME_SCHEDULES, WARMUP_SCHEDULES, forwards_before_first_backward, generate
from ..pipeline.meshes import stage_mesh
from ..pipeline.simulate import Costs, simulate
from ..resharding import ShardingSpec, plan_resharding
from .costs import ClusterSpec, ModelShape, StageCosts, stage_costs

__all__ = ["Candidate", "PlanError", "plan_layouts", "STRATEGIES"]

STRATEGIES = ("allgather", "broadcast", "sendrecv")
"""Resharding strategies the planner considers (``signal`` is a benchmark bound, not a strategy)."""


class PlanError(ValueError):
    """No layout fits, or the inputs are inconsistent (the message says which and why)."""


@dataclass
class Candidate:
    """One layout with its predicted cost."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    num_microbatches: int
    schedule: str
    delay_wgrad: bool
    strategy: str
    sequence_parallel: bool
    recompute: bool
    zero: int
    order: str
    step_s: float = math.inf
    estimate_s: float = math.inf
    bubble: float = 0.0
    memory_gib: list[float] = field(default_factory=list)
    live_microbatches: list[int] = field(default_factory=list)
    edge_s: float = 0.0
    tp_bytes: int = 0
    pp_nic_bytes: int = 0
    dp_nic_bytes: int = 0
    bottleneck: str = ""
    breakdown: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0

    @property
    def name(self) -> str:
        return (f"tp{self.tp} pp{self.pp} dp{self.dp} mb{self.micro_batch} {self.schedule}"
                f"{'+dw' if self.delay_wgrad else ''} {self.strategy}"
                f"{' sp' if self.sequence_parallel else ''}{' recompute' if self.recompute else ''} zero{self.zero}")

    def flags(self) -> str:
        """The trainer's flags for this layout (Megatron's names where Megatron has them)."""
        f = [f"--tensor-model-parallel-size {self.tp}", f"--pipeline-model-parallel-size {self.pp}",
             f"--micro-batch-size {self.micro_batch}", f"--pipeline-schedule {self.schedule}",
             f"--reshard-strategy {self.strategy}", f"--rank-order {self.order}"]
        if self.delay_wgrad:
            f.append("--delay-wgrad-compute")
        if self.sequence_parallel:
            f.append("--sequence-parallel")
        if self.recompute:
            f.append("--recompute-activations --recompute-granularity full")
        if self.zero:
            f.append(f"--zero-stage {self.zero}")
        return " ".join(f)

    def to_dict(self) -> dict[str, Any]:
        keys = ("tp", "pp", "dp", "micro_batch", "num_microbatches", "schedule", "delay_wgrad", "strategy",
                "sequence_parallel", "recompute", "zero", "order", "step_s", "estimate_s", "bubble", "memory_gib",
                "live_microbatches", "edge_s", "tp_bytes", "pp_nic_bytes", "dp_nic_bytes", "bottleneck",
                "breakdown", "tokens_per_s")
        return {k: getattr(self, k) for k in keys} | {"name": self.name, "flags": self.flags()}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class _Shape:
    """A layout without its schedule and strategy: what memory and the stage costs depend on."""

    tp: int
    pp: int
    dp: int
    b: int
    m: int
    sp: bool
    recompute: bool
    zero: int
    topo: Topology
    stages: list[StageCosts]


def _shapes(model: ModelShape, cluster: ClusterSpec, global_batch: int, micro_batches: Iterable[int],
            zero_stages: Iterable[int], recompute_options: Iterable[bool]) -> Iterable[_Shape]:
    D, N, L = cluster.devices_per_host, cluster.world, model.num_layers
    for tp in _divisors(D):
        if model.num_attention_heads % tp or model.groups % tp:
            continue
        for pp in _divisors(L):
            if N % (tp * pp):
                continue
            dp = N // (tp * pp)
            volume = CommVolume.for_gpt(model.hidden_size, model.seq_length, 1, tp=tp, dp=dp, pp=pp)
            # tp innermost (inside a host: its collectives are costed on the intra-host link), then dp and
            # pp by communication volume
            order = ("tp",) + tuple(a for a in volume.order() if a != "tp")
            topo = Topology(N, tp=tp, pp=pp, nproc_per_node=D, order=order)
            cross = hosts_spanned(topo, "dp") > 1
            per_host = min(D, tp * dp)
            for b in micro_batches:
                if global_batch % (b * dp):
                    continue
                m = global_batch // (b * dp)
                for sp in ((False, True) if tp > 1 else (False,)):
                    for rc in recompute_options:
                        for z in (zero_stages if dp > 1 else (0,)):
                            per = L // pp
                            stages = [stage_costs(model, cluster, layers=per, first=i == 0, last=i == pp - 1, tp=tp,
                                                  dp=dp, micro_batch=b, sequence_parallel=sp, recompute=rc, zero=z,
                                                  dp_crosses_hosts=cross, dp_ranks_per_host=per_host)
                                      for i in range(pp)]
                            yield _Shape(tp, pp, dp, b, m, sp, rc, z, topo, stages)


def _edge_seconds(model: ModelShape, cluster: ClusterSpec, sh: _Shape, strategy: str,
                  cache: dict[tuple, tuple[float, int]]) -> tuple[float, int]:
    """Predicted seconds of one stage-boundary transfer (the resharding planner + network model), and
    the bytes through the busiest NIC side."""
    if sh.pp == 1:
        return 0.0, 0
    key = (sh.tp, sh.dp, sh.b, sh.sp, strategy, sh.topo.order)  # every edge of a uniform layout alike
    if key not in cache:
        spec = ShardingSpec.parse("S1,S0,R" if sh.sp else "R,S0,R")
        shape = (model.seq_length, sh.b * sh.dp, model.hidden_size)
        plan = plan_resharding(shape, stage_mesh(sh.topo, 0), spec, stage_mesh(sh.topo, 1), spec, strategy=strategy,
                               scheduler="loadbalance", itemsize=2, time_budget_s=0.05)
        net = cluster.network
        busiest = max((max(i, o) for i, o in net.host_bytes(plan).values()), default=0)
        cache[key] = (net.predict(plan, order="concurrent"), int(busiest))
    return cache[key]


def _memory(sh: _Shape, live: list[int]) -> list[float]:
    return [(st.static_bytes + k * st.activation_bytes_per_mb + st.extra_bytes) / 2**30
            for st, k in zip(sh.stages, live)]


def _estimate(sh: _Shape, edge_s: float) -> float:
    fb = max(st.forward_s + st.backward_s for st in sh.stages)
    pipe = max((sh.m + sh.pp - 1) * fb, 2 * sh.m * edge_s + (sh.pp - 1) * fb)
    return pipe + max(st.dp_seconds for st in sh.stages)


def _pipeline(name: str, dw: bool, P: int, m: int, f: tuple[float, ...], b: tuple[float, ...], edge_s: float,
              cache: dict[tuple, tuple[float, Any]]) -> tuple[float, Any]:
    """(makespan for m microbatches, the timeline it was taken from): simulated, extrapolated in m."""
    key = (name, dw, P, m, f, b, edge_s)
    if key not in cache:
        costs = Costs(f=list(f), b=list(b), comm=edge_s)

        def run(n: int):
            return simulate(generate(name, P, n, dw), costs=costs)

        m1 = 3 * P + 2  # past every schedule's warm-up transient (eager: 2(P - i) - 1 forwards)
        if P == 1 or m <= m1 + 8:
            tl = run(m)
            cache[key] = (tl.makespan, tl)
        else:
            t1, t2, tl = run(m1).makespan, run(m1 + 4).makespan, run(m1 + 8)
            if abs((tl.makespan - t2) - (t2 - t1)) > 1e-9 * tl.makespan:  # not yet linear: simulate it all
                tl = run(m)
                cache[key] = (tl.makespan, tl)
            else:
                cache[key] = (tl.makespan + (m - m1 - 8) * (tl.makespan - t2) / 4, tl)
    return cache[key]


def _simulate(c: Candidate, sh: _Shape, cluster: ClusterSpec, cache: dict[tuple, tuple[float, Any]]) -> None:
    """Score `c` with the schedule simulator (extrapolated in m), fill its metrics."""
    P, m = sh.pp, sh.m
    f = [st.forward_s for st in sh.stages]
    b = [st.backward_s for st in sh.stages]
    pipe, tl = _pipeline(c.schedule, c.delay_wgrad, P, m, tuple(f), tuple(b), c.edge_s, cache)
    # each stage's dp reduction starts after its last backward compute
    ends = [max((iv.end for iv in row), default=0.0) for row in tl.compute]
    exposed = max(max(0.0, st.dp_seconds + e - tl.makespan) for st, e in zip(sh.stages, ends))
    c.step_s = pipe + exposed
    busy = [m * (fi + bi) for fi, bi in zip(f, b)]
    c.bubble = max(0.0, 1 - sum(busy) / (P * pipe)) if pipe > 0 else 0.0
    peaks = tl.peak_activations
    c.live_microbatches = [max(p, forwards_before_first_backward(c.schedule, P, m, i)) for i, p in enumerate(peaks)]
    c.memory_gib = [round(x, 2) for x in _memory(sh, c.live_microbatches)]
    tp_s = m * max(st.tp_bytes_per_mb for st in sh.stages) / cluster.intra_Bps
    c.breakdown = {"compute": max(0.0, max(busy) - tp_s), "tp collectives": tp_s,
                   "pipeline bubble": max(0.0, pipe - max(busy)), "dp reduction (exposed)": exposed}
    c.bottleneck = max(c.breakdown, key=c.breakdown.get)
    if c.edge_s and 2 * m * c.edge_s > max(busy):
        c.bottleneck = "stage transfers (NIC)"


def plan_layouts(model: ModelShape, cluster: ClusterSpec, global_batch: int, *,
                 micro_batches: Iterable[int] = (1, 2, 4, 8), schedules: Iterable[str] | None = None,
                 strategies: Iterable[str] = STRATEGIES, zero_stages: Iterable[int] = (0, 1, 2),
                 recompute_options: Iterable[bool] = (False, True), top_shapes: int = 6,
                 stats: dict[str, int] | None = None) -> list[Candidate]:
    """Every layout that fits, best first: the `top_shapes` best shapes scored by simulation (each
    with every schedule × delayed W × strategy), then the rest by their analytic estimate.

    ``stats`` (a dict) receives counts: enumerated, pruned by memory, simulated.
    """
    if global_batch < 1 or model.num_layers < 1 or cluster.hosts < 1 or cluster.devices_per_host < 1:
        raise PlanError(f"need a positive global batch, layers, hosts and devices per host (got global batch "
                        f"{global_batch}, {model.num_layers} layers, {cluster.hosts} hosts × "
                        f"{cluster.devices_per_host} devices)")
    if model.hidden_size % model.num_attention_heads:
        raise PlanError(f"hidden size {model.hidden_size} is not divisible by {model.num_attention_heads} heads")
    # the memory model counts live activations with the warm-up rule of the one-stage-per-rank schedules
    plannable = [n for n in RUNTIME_SCHEDULES if n in WARMUP_SCHEDULES]
    names = list(schedules) if schedules is not None else plannable
    unknown = [s for s in names if s not in plannable]
    if unknown:
        raise PlanError(f"schedule(s) {unknown} cannot be planned: the planner models {', '.join(plannable)}")
    strategies = list(strategies)
    st = stats if stats is not None else {}
    st.update(enumerated=0, pruned_memory=0, simulated=0)
    cache: dict[tuple, tuple[float, int]] = {}
    limit = cluster.memory_bytes / 2**30
    scored: list[tuple[float, _Shape, list[Candidate]]] = []
    for sh in _shapes(model, cluster, global_batch, micro_batches, zero_stages, recompute_options):
        order = "-".join(sh.topo.order)
        variants: list[Candidate] = []
        for name in names:
            for dw in ((False, True) if name != "gpipe" and sh.pp > 1 else (False,)):
                live = [forwards_before_first_backward(name, sh.pp, sh.m, i) + (1 if dw else 0)
                        for i in range(sh.pp)]
                mem = _memory(sh, [min(k, sh.m) for k in live])
                for strategy in (strategies if sh.pp > 1 else strategies[:1]):
                    st["enumerated"] += 1
                    if max(mem) > limit:
                        st["pruned_memory"] += 1
                        continue
                    edge_s, busiest = _edge_seconds(model, cluster, sh, strategy, cache)
                    c = Candidate(sh.tp, sh.pp, sh.dp, sh.b, sh.m, name, dw, strategy, sh.sp, sh.recompute, sh.zero,
                                  order, edge_s=edge_s, memory_gib=[round(x, 2) for x in mem],
                                  live_microbatches=live)
                    c.estimate_s = c.step_s = _estimate(sh, edge_s)
                    c.tp_bytes = sh.m * max(s.tp_bytes_per_mb for s in sh.stages)
                    c.pp_nic_bytes = 2 * sh.m * busiest
                    c.dp_nic_bytes = max(s.dp_nic_bytes for s in sh.stages)
                    variants.append(c)
        if variants:
            scored.append((min(v.estimate_s for v in variants), sh, variants))
    if not scored:
        raise PlanError(f"no layout fits {cluster.device_memory_gib:g} GiB per device (minus "
                        f"{cluster.memory_reserve:.0%} reserve): {st['pruned_memory']} of {st['enumerated']} "
                        "candidates pruned by memory; add devices, or allow recomputation / ZeRO")
    scored.sort(key=lambda x: x[0])
    sims: dict[tuple, tuple[float, Any]] = {}
    out: list[Candidate] = []
    for i, (_, sh, variants) in enumerate(scored):
        for c in variants:
            if i < top_shapes:
                _simulate(c, sh, cluster, sims)
                if max(c.memory_gib) > limit:  # the simulated live set is larger than the bound used
                    st["pruned_memory"] += 1
                    continue
            c.tokens_per_s = global_batch * model.seq_length / c.step_s if c.step_s > 0 else 0.0
            out.append(c)
    st["simulated"] = len(sims)
    simulated = [c for c in out if c.breakdown]
    rest = [c for c in out if not c.breakdown]
    # ties (ZeRO stages, strategies that move the same bytes) go to the smaller memory footprint
    return (sorted(simulated, key=lambda c: (round(c.step_s, 9), max(c.memory_gib)))
            + sorted(rest, key=lambda c: (round(c.estimate_s, 9), max(c.memory_gib))))
