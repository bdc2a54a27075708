"""Search: enumerate layouts, prune by memory, pre-rank analytically, score the best by simulation (pure).

Candidates: tp (a divisor of the devices per host that divides the heads and key/value
groups: tp stays inside a host, placed innermost; dp and pp follow by communication volume), pp (up to the
layers; an even split where pp divides them, and the balanced uneven split of `variants.py` where that
is faster), dp = world / (tp·pp), per-stage meshes near each uniform layout (`--stage-layouts`), the
micro batch (the global batch must split into micro batch × dp), every schedule of the
registry with and without delayed weight gradients where that means something (the virtual-stage ones with
every V they allow), every executable resharding strategy, sequence parallelism when tp > 1, full
recomputation on or off, ZeRO 0/1/2. Ranks are placed by communication volume (tp innermost, as the
trainer does), per-stage meshes on contiguous rank blocks, so each stage's mesh and hosts follow.

1. **Memory** prunes first: a candidate whose mesh needs more than the device holds (static
   state of its stages + live microbatches × activations + logits, `costs.py`; live counts from
   `variants.live_bound`) is dropped, with the reason counted.
2. **Pre-rank**: ``(m + (P − 1)/V)·max_stage(F + B)`` against the NIC-bound ``2·m·t_edge`` (every
   stage sends m activations and m gradients), plus the exposed data-parallel reduction.
3. **Score**: the best few shapes (every schedule × strategy × delayed W of each; then, while a shape's
   estimate still beats the best simulated step, the next ones, up to four times as many) run through
   the pipeline simulator with the per-stage F/B times (+ `ClusterSpec.action_overhead_s` per compute
   action) and the resharding planner's predicted transfer time per edge (+ the latency of the messages
   its strategy sends, at the busiest rank); long runs are extrapolated from steady-state
   simulations (the step grows linearly in m once every stage is in its steady phase; two
   equal increments are required, otherwise the whole run is simulated).
   The data-parallel reduction of a mesh (its stages' gradients bucketed together, `costs.mesh_dp_seconds`)
   starts after its last backward; what does not fit
   before the step's end is added, then the optimizer step and the one-element all-reduces every step
   ends with (`step_sync_s`: loss, gradient norm, non-finite check, dp mean).

Extra cost terms (`terms.py`: none unless the caller gives some, as the lab does for its emulated cluster's
shared cores) apply to both the pre-rank's estimate and the simulated step.

Where: the enumeration in `shapes.py`, memory and the pre-rank's estimate in `estimate.py`, the pipeline's
simulation in `makespan.py`; this module scores (the resharding planner's edges, `_simulate`) and ranks.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from ..pipeline.generators import placement_of
from ..pipeline.schedules import get_schedule, schedule_names
from ..resharding import ShardingSpec, plan_resharding, strategy_names
from ..resharding.messages import build_messages
from .candidate import Candidate
from .costs import ClusterSpec, ModelShape, mesh_dp_seconds
from .estimate import _boundaries, _edge_bound, _estimate, _estimate_parts, _memory, _mesh_static
from .makespan import _edge_arg, _pipeline, pipeline_makespan
from .shapes import _Shape, _schedule_options, _shapes, _stage_mesh_shapes, _virtualize
from .shapes import _dp_ring_cross  # noqa: F401  (importable from here, as before)
from .step_collectives import step_sync_s, tied_embedding_s
from .terms import CostTerm, TermInput, check_terms
from .variants import live_bound

__all__ = ["Candidate", "PlanError", "plan_layouts", "planned_strategies", "pipeline_makespan"]  # Candidate: from candidate.py

def planned_strategies() -> tuple[str, ...]:
    """The resharding strategies the planner considers: every registered one it may choose (a benchmark's bound
    such as the lab's ``signal`` is not a choice), in name order."""
    return tuple(sorted(strategy_names(planned=True)))


class PlanError(ValueError):
    """No layout fits, or the inputs are inconsistent (the message says which and why)."""


def _edge_seconds(model: ModelShape, cluster: ClusterSpec, sh: _Shape, strategy: str,
                  cache: dict[tuple, Any]) -> tuple[dict[str, float], dict[str, float], int]:
    """Predicted seconds of every cross-mesh stage-boundary transfer (the resharding planner + network
    model), keyed by the edge text ``"i->i+1"``, or ``"*"`` when every boundary costs the same (and for
    virtual stages: the slowest boundary): with every data-parallel replica's rows on the wire at once, and
    with one replica's rows alone (its destination row's tasks: `_replica_seconds`); and the bytes through
    the busiest NIC side of one transfer (every replica)."""
    if sh.pp == 1:
        return {"*": 0.0}, {"*": 0.0}, 0
    max_dp = max(d for _, d in sh.mesh_layouts())
    spec = ShardingSpec.parse("S1,S0,R" if sh.sp else "R,S0,R")
    shape = (model.seq_length, sh.b * max_dp, model.hidden_size)
    out: dict[str, float] = {}
    solo: dict[str, float] = {}
    busiest = 0
    for i, j, pattern, src, dst in _boundaries(sh, cache):
        key = ("edge", pattern, shape, sh.sp, strategy)
        if key not in cache:
            plan = plan_resharding(shape, src, spec, dst, spec, strategy=strategy, scheduler="loadbalance",
                                   itemsize=model.dtype_bytes, time_budget_s=0.05)
            net = cluster.network
            latency = _message_latency(plan, cluster)
            cache[key] = (net.predict(plan, order="concurrent") + latency,
                          _replica_seconds(plan, net) + latency,
                          int(max((max(a, b) for a, b in net.host_bytes(plan).values()), default=0)))
        t, t1, nb = cache[key]
        out[f"{i}->{j}"] = t
        solo[f"{i}->{j}"] = t1
        busiest = max(busiest, nb)
    if (len(set(out.values())) == 1 and len(set(solo.values())) == 1) or sh.virtual > 1:
        return {"*": max(out.values())}, {"*": max(solo.values())}, busiest
    return out, solo, busiest


def _replica_seconds(plan, net) -> float:
    """Seconds of one data-parallel replica's part of a boundary transfer with the wire to itself: the
    concurrent prediction of the tasks that one destination row (its tp ranks) receives, the slowest row.
    Rows whose transfers share a NIC run out of step in a real pipeline, so a transfer meets the other
    replicas' only part of the time (`_shared_edges`)."""
    rows: dict[int, list] = {}
    row_of = {r: k for k, row in enumerate(plan.dst_mesh.ranks) for r in row}
    for task in plan.tasks:
        for k in sorted({row_of[r] for r in task.receivers}):
            rows.setdefault(k, []).append(task)
    return max((net.predict(plan, order="concurrent", tasks=ts) for ts in rows.values()), default=0.0)


def _message_latency(plan, cluster: ClusterSpec) -> float:
    """Fixed seconds of a resharding plan's messages: the messages its strategy sends (`build_messages`, as
    the executor builds them), each at the latency of its link, summed per rank (a rank posts its sends and
    receives one after another) and taken at the busiest rank."""
    host_of = {r: plan.dst_mesh.host_of(r) for r in plan.dst_mesh.flat_ranks}
    host_of.update({r: plan.src_mesh.host_of(r) for r in plan.src_mesh.flat_ranks})
    per_rank: dict[int, float] = {}
    for task in plan.tasks:
        held = set(task.senders)
        remote = sorted(r for r in task.receivers if r not in held)
        for msg in build_messages(plan.strategy, task.numel, task.sender, remote, host_of, int(task.chunks)):
            a = cluster.intra_latency_s if host_of[msg.src] == host_of[msg.dst] else cluster.nic_latency_s
            for r in (msg.src, msg.dst):
                per_rank[r] = per_rank.get(r, 0.0) + a
    return max(per_rank.values(), default=0.0)


def _shared_edges(edges: dict[str, float], solo: dict[str, float], tl: Any) -> tuple[dict[str, float], float]:
    """Boundary transfers whose NIC the data-parallel replicas share (`edges` > `solo`): the simulator runs one
    replica, so each transfer takes its own time `solo` plus the others' extra (`edges` − `solo`) for the
    share u of the time they hold the NIC — one replica's busiest NIC side in `tl`, a timeline simulated
    with the `solo` times, over its makespan. Replicas run out of step (measured: 8–18 ms a transfer where
    one alone takes 11 and two at once 22), so assuming they always collide (u = 1) overstates the edges.
    Also returns the bound the shared NIC puts on the pipeline: the busiest side's busy time with every
    replica's bytes."""
    scale = {k: (edges[k] / solo[k] if solo[k] > 0 else 1.0) for k in edges}
    busy: dict[tuple[str, int], list[float]] = {}
    for iv in tl.comm:
        k = "*" if "*" in scale else str(iv.edge)
        for side in (("send", iv.sender), ("recv", iv.receiver)):
            b = busy.setdefault(side, [0.0, 0.0])
            b[0] += iv.end - iv.start
            b[1] += (iv.end - iv.start) * scale[k]
    u = min(1.0, max((b[0] for b in busy.values()), default=0.0) / tl.makespan) if tl.makespan > 0 else 0.0
    return ({k: solo[k] + (edges[k] - solo[k]) * u for k in edges},
            max((b[1] for b in busy.values()), default=0.0))


def _simulate(c: Candidate, sh: _Shape, cluster: ClusterSpec, edges: dict[str, float], solo: dict[str, float],
              cache: dict[tuple, Any], model: ModelShape, terms: Sequence[CostTerm] = (),
              term_cache: dict[tuple, Any] | None = None) -> None:
    """Score `c` with the schedule simulator (extrapolated in m), fill its metrics; then apply the extra cost
    `terms` in order (`terms.py`; `term_cache`: their `TermInput.cache`)."""
    P, m = sh.pp, sh.m
    f = tuple(st.forward_s for st in sh.stages)
    b = tuple(st.backward_s for st in sh.stages)
    w = tuple(st.wgrad_s for st in sh.stages)
    args = (c.schedule, c.delay_wgrad, P, m, f, b)
    rest = (cache, sh.virtual, cluster.action_overhead_s, w, (cluster.send_post_s, cluster.recv_post_s))
    if any(solo[k] < edges[k] for k in edges):  # replicas share a NIC: simulate one alone, then the sharing
        pipe1, tl1 = _pipeline(*args, _edge_arg(solo), *rest)
        edges, nic_bound = _shared_edges(edges, solo, tl1)
        pipe, tl = _pipeline(*args, _edge_arg(edges), *rest)
        pipe = max(pipe, nic_bound * pipe1 / tl1.makespan if tl1.makespan > 0 else 0.0)
    else:
        pipe, tl = _pipeline(*args, _edge_arg(edges), *rest)
    placement = placement_of(c.schedule, P, sh.virtual) if sh.virtual > 1 else tuple(range(P))
    groups = sh.per_mesh(placement)
    # each mesh's dp reduction starts after its last backward compute; the first and last meshes first
    # all-reduce the tied embedding's gradient, which waits for the later of the two
    ends = [max((iv.end for iv in row), default=0.0) for row in tl.compute]
    first, last = placement[0], placement[-1]
    tied = tied_embedding_s(model, cluster, sh, first, last, cache) if P > 1 else 0.0
    if tied:
        both = max(ends[first], ends[last]) + tied
        ends[first] = ends[last] = both
    reduce_s = [mesh_dp_seconds(cluster, g, dp, crosses) for g, (_, dp), (crosses, _) in
                zip(groups, sh.mesh_layouts(), sh.cross, strict=True)]
    exposed = max(max(0.0, r + e - tl.makespan) for r, e in zip(reduce_s, ends))
    optimizer = max(sum(st.optimizer_s for st in g) for g in groups)  # after the step's last reduction
    sync = step_sync_s(cluster, sh)
    c.step_s = pipe + exposed + optimizer + sync
    o = cluster.action_overhead_s * (3 if c.delay_wgrad else 2)  # F and B, or F, I and W
    busy = [m * sum(st.forward_s + st.backward_s + o for st in g) for g in groups]
    c.bubble = max(0.0, 1 - sum(busy) / (P * pipe)) if pipe > 0 else 0.0
    peaks = tl.peak_activations
    c.live_microbatches = [max(p, k) for p, k in zip(peaks, live_bound(c.schedule, c.delay_wgrad, P, m,
                                                                         sh.virtual))]
    c.memory_gib = [round(x, 2) for x in _memory(sh, placement, c.live_microbatches)]
    tp_s = m * max(sum(st.tp_bytes_per_mb / cluster.intra_Bps + st.tp_latency_s for st in g) for g in groups)
    overhead = m * max(len(g) for g in groups) * o
    c.breakdown = {"compute": max(0.0, max(busy) - tp_s - overhead), "tp collectives": tp_s,
                   "action overhead": overhead,
                   "pipeline bubble": max(0.0, pipe - max(busy)),
                   "dp reduction + tied embedding (exposed)": exposed,
                   "optimizer step": optimizer, "step-end all-reduces (loss, norm, checks)": sync}
    c.bottleneck = max(c.breakdown, key=c.breakdown.get)
    if c.edge_s and 2 * m * c.edge_s > max(busy):
        c.bottleneck = "stage transfers (NIC)"
    if terms:
        at = TermInput(model, cluster, sh, placement, c.delay_wgrad, {} if term_cache is None else term_cache)
        for term in terms:
            quantity = c.terms[term.name] = term.measure(at)
            out = term.apply(c.step_s, quantity, at)
            c.breakdown.update(out.breakdown)
            c.bottleneck = out.bottleneck or c.bottleneck
            c.step_s = out.step_s


def plan_layouts(model: ModelShape, cluster: ClusterSpec, global_batch: int, *,
                 micro_batches: Iterable[int] = (1, 2, 4, 8), schedules: Iterable[str] | None = None,
                 strategies: Iterable[str] | None = None, zero_stages: Iterable[int] = (0, 1, 2),
                 recompute_options: Iterable[bool] = (False, True), top_shapes: int = 6,
                 uneven_splits: bool = True, stage_meshes: bool = True, runtime_only: bool = False,
                 keep: int | None = 2000, stats: dict[str, int] | None = None,
                 terms: Sequence[CostTerm] = ()) -> list[Candidate]:
    """The layouts that fit, best first: the `top_shapes` best shapes scored by simulation (each with every
    schedule × delayed W × strategy), then the best `keep` others by their analytic estimate (None: all).

    `schedules` defaults to every registered one; a schedule without a live-activation bound is refused by
    name. The pipeline runtime executes every registered schedule: every candidate's `runtime` is true and
    `runtime_only` keeps them all.
    ``stats`` (a dict) receives counts: enumerated, pruned by memory, simulated. `terms`: extra cost terms
    (`terms.py`), applied in order to every estimate and simulated step; none by default (a real cluster).
    """
    if global_batch < 1 or model.num_layers < 1 or cluster.hosts < 1 or cluster.devices_per_host < 1:
        raise PlanError(f"need a positive global batch, layers, hosts and devices per host (got global batch "
                        f"{global_batch}, {model.num_layers} layers, {cluster.hosts} hosts × "
                        f"{cluster.devices_per_host} devices)")
    if model.hidden_size % model.num_attention_heads:
        raise PlanError(f"hidden size {model.hidden_size} is not divisible by {model.num_attention_heads} heads")
    check_terms(terms)
    names = list(schedules) if schedules is not None else list(schedule_names())
    unknown = [s for s in names if s not in schedule_names()]
    if unknown:
        raise PlanError(f"unknown schedule(s) {unknown}: the registry has {', '.join(schedule_names())}")
    unbounded = [s for s in names if get_schedule(s).live_bound is None]
    if unbounded:
        raise PlanError(f"schedule(s) {unbounded} give no live-activation bound (ScheduleKind.live_bound): the "
                        "planner cannot size their memory; give one, or leave them out of the schedules planned")
    runnable = set(schedule_names())  # the runtime executes every registered kind
    if runtime_only:
        names = [n for n in names if n in runnable]
        if not names:
            raise PlanError(f"none of the schedules asked for runs in the pipeline runtime ({', '.join(runnable)})")
    strategies = list(strategies if strategies is not None else planned_strategies())
    terms = tuple(terms)
    st = stats if stats is not None else {}
    st.update(enumerated=0, pruned_memory=0, simulated=0)
    bounds: dict[tuple, Any] = {}  # boundaries and their quick bounds, per placement
    limit = cluster.memory_bytes / 2**30
    # phase 1: every shape × schedule × delayed W × strategy that fits, as light tuples with its estimate
    Row = tuple[float, str, bool, str, list[int], list[float]]
    groups: list[tuple[float, _Shape, list[Row]]] = []

    def add(base: _Shape) -> None:
        # per (v, placement): the stages' costs depend on which mesh holds both ends of the model
        shapes: dict[tuple[int, tuple[int, ...]], _Shape] = {(1, tuple(range(base.pp))): base}
        by_shape: dict[tuple[int, tuple[int, ...]], list[Row]] = {}
        for name, v in _schedule_options(names, base, model.num_layers):
            placement = placement_of(name, base.pp, v) if v > 1 else tuple(range(base.pp))
            key = (v, placement)
            if key not in shapes:
                shapes[key] = _virtualize(model, cluster, base, v, placement)
            sh = shapes[key]
            static = _mesh_static(sh, placement)
            parts = _estimate_parts(sh, cluster.action_overhead_s, cluster.send_post_s + cluster.recv_post_s)
            if sh.pp > 1:  # the tied embedding's all-reduce comes after the pipeline, before the step
                parts = (parts[0], parts[1] + tied_embedding_s(model, cluster, sh, placement[0], placement[-1], bounds))
            parts = (parts[0], parts[1] + step_sync_s(cluster, sh))
            strats = strategies if sh.pp > 1 else strategies[:1]
            kind = get_schedule(name)
            for dw in ((True,) if kind.zero_bubble else
                       (False, True) if kind.search_delay_wgrad and sh.pp > 1 else (False,)):
                live = live_bound(name, dw, sh.pp, sh.m, v)
                mem = [(a + k * x) / 2**30 for (a, x), k in zip(static, live)]
                st["enumerated"] += len(strats)
                if max(mem) > limit:
                    st["pruned_memory"] += len(strats)
                    continue
                at = TermInput(model, cluster, sh, placement, dw, bounds) if terms else None
                measured = [(term, term.measure(at)) for term in terms]
                for strategy in strats:
                    est = _estimate(sh, parts, _edge_bound(model, cluster, sh, strategy, bounds), name)
                    for term, quantity in measured:
                        est = term.apply(est, quantity, at).step_s
                    by_shape.setdefault(key, []).append((est, name, dw, strategy, live, mem))
        for key, rows in by_shape.items():
            groups.append((min(r[0] for r in rows), shapes[key], rows))

    for base in _shapes(model, cluster, global_batch, micro_batches, zero_stages, recompute_options, uneven_splits):
        add(base)
    if stage_meshes:  # per-stage meshes around the best uniform shapes (the pre-rank's top 4 × top_shapes)
        groups.sort(key=lambda x: x[0])
        topos: dict[tuple, tuple[Any, list]] = {}
        seen = set()
        for _, sh, _ in [g for g in groups if g[1].virtual == 1 and g[1].pp > 1][:4 * top_shapes]:
            k = (sh.tp, sh.pp, sh.b, sh.sp, sh.recompute, sh.zero)
            if k not in seen:
                seen.add(k)
                for var in _stage_mesh_shapes(model, cluster, global_batch, sh, uneven_splits, topos):
                    add(var)
    if not groups:
        raise PlanError(f"no layout fits {cluster.device_memory_gib:g} GiB per device (minus "
                        f"{cluster.memory_reserve:.0%} reserve): {st['pruned_memory']} of {st['enumerated']} "
                        "candidates pruned by memory; add devices, or allow recomputation / ZeRO")
    groups.sort(key=lambda x: x[0])
    # phase 2: the best shapes with the resharding planner's edges and the simulator; the rest as estimated
    edge_cache = bounds  # the resharding planner's edge times, per host pattern
    sims: dict[tuple, tuple[float, Any]] = {}
    simulated: list[Candidate] = []
    rest: list[tuple[float, _Shape, tuple]] = []
    best = math.inf
    scored = 0
    for i, (est, sh, rows) in enumerate(groups):
        # the `top_shapes` best estimates, and past them every shape whose estimate still beats the best
        # simulated step (the estimate can be optimistic), up to 4 × top_shapes shapes in all
        if not (i < top_shapes or (est < best and scored < 4 * top_shapes)):
            rest += [(r[0], sh, r) for r in rows]
            continue
        scored += 1
        for row in rows:
            est, name, dw, strategy, live, mem = row
            edges, solo, busiest = _edge_seconds(model, cluster, sh, strategy, edge_cache)
            c = _candidate(model, sh, row, runnable, max(edges.values()), busiest)
            _simulate(c, sh, cluster, edges, solo, sims, model, terms, bounds)
            if max(c.memory_gib) > limit:  # the simulated live set is larger than the bound used
                st["pruned_memory"] += 1
                continue
            c.tokens_per_s = global_batch * model.seq_length / c.step_s if c.step_s > 0 else 0.0
            simulated.append(c)
            best = min(best, c.step_s)
    st["simulated"] = len(sims)
    rest.sort(key=lambda x: x[0])
    others = []
    for est, sh, row in (rest if keep is None else rest[:keep]):
        c = _candidate(model, sh, row, runnable, _edge_bound(model, cluster, sh, row[3], bounds), None)
        c.tokens_per_s = global_batch * model.seq_length / c.step_s if c.step_s > 0 else 0.0
        others.append(c)
    # ties (ZeRO stages, strategies that move the same bytes) go to the smaller memory footprint
    return (sorted(simulated, key=lambda c: (round(c.step_s, 9), max(c.memory_gib)))
            + sorted(others, key=lambda c: (round(c.estimate_s, 9), max(c.memory_gib))))


def _candidate(model: ModelShape, sh: _Shape, row: tuple, runnable: set[str], edge_s: float,
               busiest: int | None) -> Candidate:
    est, name, dw, strategy, live, mem = row
    c = Candidate(sh.tp, sh.pp, sh.dp, sh.b, sh.m, name, dw, strategy, sh.sp, sh.recompute, sh.zero, sh.order,
                  layers_per_stage=sh.layers if sh.uneven else None,
                  stage_layouts=",".join(f"tp{t}dp{d}" for t, d in sh.layouts) if sh.layouts else None,
                  virtual_stages=sh.virtual, runtime=name in runnable, edge_s=edge_s,
                  memory_gib=[round(x, 2) for x in mem], live_microbatches=list(live),
                  stage_f_s=[s.forward_s for s in sh.stages], stage_b_s=[s.backward_s for s in sh.stages],
                  stage_w_s=[s.wgrad_s for s in sh.stages])
    c.estimate_s = c.step_s = est
    c.tp_bytes = sh.m * max(s.tp_bytes_per_mb for s in sh.stages)
    if busiest is not None:
        c.pp_nic_bytes = 2 * sh.m * busiest
    c.dp_nic_bytes = max(s.dp_nic_bytes for s in sh.stages)
    return c
