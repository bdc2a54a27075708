"""The records of lab/bench/bench_pipeline.py: one per configuration, measured or simulated, and their numbers.

``make_records`` turns per-round times (and traces) into records: medians and quartiles, tokens/s, the network
model's view of the stage boundaries (``edge_transfer_model``: bytes and seconds per transfer, per strategy),
the measured per-action medians, peak microbatches in flight, then ``fill_physical`` (the physical bound,
lab/bench/physical_bound.py) and ``fill_ratios`` (speedups, fractions of the signal bound, gap closure, void).
``costs_from_records``/``load_cost_records``/``_costs`` give the per-action F/B/I/W costs of a measured run (or
the flags'), and ``simulate_records`` the same records from the simulator at those costs.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import Any, Sequence

from lab.bench import pipeline_grid  # GRID_KIND: a grid JSON's cost records
import lab.signal  # noqa: F401 (registers the `signal` bound these benchmarks run)
from lab.bench.pipeline_args import BenchConfig, graph_and_shapes, parse_model_config


# ---- the network model's view of the stage boundaries ---------------------------------------------------
def edge_transfer_model(a: argparse.Namespace, configs: Sequence[BenchConfig], world: int,
                        procs_per_host: int) -> dict[str, dict[str, float]]:
    """Per strategy, for one microbatch's forward tensors: bytes out of the busiest NIC (all edges
    added up), and the model's seconds to send everything one stage sends (edges of a stage added up,
    the busiest stage). For the GPT that is one edge 0->1."""
    from megareshard.parallel import CommVolume, Topology
    from megareshard.pipeline.stage import stage_layouts
    from megareshard.resharding import plan_resharding
    from megareshard.resharding.network import NetworkModel

    cfg, spec = parse_model_config(a, configs[0], world)
    m, t = cfg.model, cfg.training
    dp = cfg.plan.dp
    order = cfg.parallel.rank_order or CommVolume.for_gpt(m.hidden_size, m.seq_length, t.micro_batch_size,
                                                           tp=cfg.tp, dp=dp, pp=cfg.pp).order()
    topo = Topology(world, tp=cfg.tp, pp=cfg.pp, nproc_per_node=procs_per_host, order=order)
    lay = spec.stage_layouts(cfg, topo) if spec is not None else stage_layouts(cfg, topo)
    graph, shapes = graph_and_shapes(cfg, spec, lay, t.micro_batch_size * dp)
    net = NetworkModel(a.nic_gbps)
    out = {}
    for strategy in sorted({c.strategy for c in configs}):
        host_out: dict[int, int] = {}
        stage_s: dict[int, float] = {}
        per_edge: dict[str, float] = {}
        side: dict[str, int] = {}  # "h{host} out|in": bytes of one microbatch, activations and gradients
        wire: dict[str, int] = {}  # per edge: the busiest NIC side's bytes of its smaller direction
        total = 0
        for e in graph.edges:
            src, dst = lay[e.src], lay[e.dst]
            if src.mesh == dst.mesh and src.hidden_spec == dst.hidden_spec:
                continue  # a local hand-off (virtual stages): nothing crosses ranks
            plans = [plan_resharding(shapes[e], a_.mesh, a_.hidden_spec, b_.mesh, b_.hidden_spec, strategy=strategy,
                                     scheduler=a.reshard_scheduler, itemsize=4, broadcast_chunks=a.reshard_chunks,
                                     time_budget_s=0.2) for a_, b_ in ((src, dst), (dst, src))]
            for h, (o, i) in net.host_bytes(plans[0]).items():
                host_out[h] = host_out.get(h, 0) + max(o, i)
            per_edge[str(e)] = net.predict(plans[0])
            stage_s[e.src] = stage_s.get(e.src, 0.0) + per_edge[str(e)]
            total = max(total, math.prod(shapes[e]) * 4)
            busiest = []
            for plan in plans:
                hb = net.host_bytes(plan)
                for h, (o, i) in hb.items():
                    side[f"h{h} out"] = side.get(f"h{h} out", 0) + o
                    side[f"h{h} in"] = side.get(f"h{h} in", 0) + i
                busiest.append(max((max(o, i) for o, i in hb.values()), default=0))
            wire[str(e)] = min(busiest)
        out[strategy] = {"nic_bytes": max(host_out.values(), default=0), "model_s": max(stage_s.values(), default=0.0),
                         "tensor_bytes": total, "edge_s": per_edge, "side_bytes": side, "wire_bytes": wire}
    return out


# ---- records: per-round times and traces to numbers -------------------------------------------------
def _action_ms(trace: list[dict[str, Any]], pp: int) -> dict[str, list[float | None]]:
    """Median duration (ms) of each compute kind per stage, and of sends (SEND_F/SEND_B, ready→done)."""
    out: dict[str, list[float | None]] = {}
    for kind in ("F", "B", "I", "W", "SEND_F", "SEND_B"):
        row = []
        for s in range(pp):
            d = [1e3 * (r["end"] - r["start"]) for r in trace if r["stage"] == s and r["kind"] == kind]
            row.append(round(statistics.median(d), 3) if d else None)
        if any(v is not None for v in row):
            out[kind] = row
    return out


def make_records(a: argparse.Namespace, configs: Sequence[BenchConfig], ms: Sequence[Sequence[float]],
                 traces: Sequence[list[dict[str, Any]] | None], world: int, procs_per_host: int, *, mode: str,
                 hosts_of_stage: list[list[int]] | None = None, costs: dict[str, Any] | None = None
                 ) -> list[dict[str, Any]]:
    """`costs`: the per-stage F/B/I/W ms the configurations' compute costs (the paced budgets, or the simulated
    costs) for the physical bound; None: the signal runs' measured action medians, where traced."""
    from megareshard.pipeline import Timeline, generate, simulate

    net = edge_transfer_model(a, configs, world, procs_per_host)
    dp = world // (a.tp * a.pp)
    tokens = a.micro_batch_size * dp * a.microbatches * a.seq_length
    recs = []
    for c, m, tr in zip(configs, ms, traces):
        med = statistics.median(m)
        q = statistics.quantiles(m, n=4) if len(m) >= 2 else [med, med, med]
        recs.append({
            "model": a.model, "config": c.name, "schedule": c.schedule, "strategy": c.strategy, "delay_wgrad": c.dw,
            "mode": mode, "ms_per_iter": med, "ms_q1": q[0], "ms_q3": q[2], "ms_min": min(m),
            "ms_all": [round(x, 3) for x in m],
            "tokens_per_s": tokens / (med / 1e3),
            "world_size": world, "procs_per_host": procs_per_host, "tp": a.tp, "pp": a.pp, "dp": dp,
            "microbatches": a.microbatches, "micro_batch_size": a.micro_batch_size, "seq_length": a.seq_length,
            "hidden_size": a.hidden_size, "num_layers": a.num_layers, "nic_gbps": a.nic_gbps,
            "transfer_bytes": net[c.strategy]["tensor_bytes"], "transfer_nic_bytes": net[c.strategy]["nic_bytes"],
            "transfer_model_ms": 1e3 * net[c.strategy]["model_s"],
            "edge_model_ms": {k: round(1e3 * v, 3) for k, v in net[c.strategy]["edge_s"].items()},
            "action_ms": _action_ms(tr, a.pp) if tr else {},
            "hosts_of_stage": hosts_of_stage,
            # peak microbatches whose activations a stage holds at once (F until B, or W): from the trace, and the
            # simulator's on the chain schedule at unit costs (docs/design.md §4, "memory shown")
            "peak_inflight_measured": Timeline.from_trace(tr).peak_activations if tr else None,
            "peak_inflight_simulated": simulate(generate(c.schedule, a.pp, a.microbatches,
                                                         delay_wgrad=c.dw)).peak_activations,
        })
    fill_physical(a, configs, recs, net, costs, world, procs_per_host)
    fill_ratios(recs, a.baseline)
    return recs


def _graph(a: argparse.Namespace, configs: Sequence[BenchConfig], world: int, pph: int):
    """The model's stage graph (None: the GPT's chain)."""
    if a.model == "gpt":
        return None
    from megareshard.parallel import Topology

    cfg, spec = parse_model_config(a, configs[0], world)
    return spec.graph(cfg, spec.stage_layouts(cfg, Topology(world, tp=a.tp, pp=a.pp, nproc_per_node=pph)))


def fill_physical(a: argparse.Namespace, configs: Sequence[BenchConfig], recs: list[dict[str, Any]],
                  net: dict[str, Any], costs: dict[str, Any] | None, world: int, pph: int) -> None:
    """Per record: ``physical`` (lab/bench/physical_bound.py: compute, NIC and critical-path terms, the bound and
    which term binds) at `costs`, or at the signal runs' measured action medians (``physical_costs``)."""
    from megareshard.pipeline import Costs, generate
    from lab.bench.physical_bound import physical_bound

    source = "paced budgets" if costs is not None else "measured action medians"
    if costs is None:
        try:
            costs = costs_from_records(recs, a.pp)
        except ValueError:  # no traces yet (a run's intermediate records): no bound
            return
    costs = _costs_filled(costs, a.pp)
    graph = _graph(a, configs, world, pph)
    for c, r in zip(configs, recs):
        n = net[c.strategy]
        sched = generate(c.schedule, a.pp, a.microbatches, delay_wgrad=c.dw, graph=graph)
        pb = physical_bound(sched, Costs(f=costs["f"], b=costs["b"], i=costs["i"], w=costs["w"]), n["wire_bytes"],
                            n["side_bytes"], a.microbatches, a.nic_gbps)
        r["physical"] = pb.record()
        r["physical_costs"] = source


def _costs_filled(m: dict[str, Any], pp: int) -> dict[str, Any]:
    """Missing kinds of a cost dict filled as `_costs` does (B = 2F, I = B/2, W = B − I)."""
    f = m["f"] or [10.0] * pp
    b = m["b"] or [2 * x for x in f]
    i = m["i"] or [x / 2 for x in b]
    w = m["w"] or [x - y for x, y in zip(b, i)]
    return {"f": f, "b": b, "i": i, "w": w}


def fill_ratios(recs: list[dict[str, Any]], baseline: str) -> None:
    """speedup_vs_baseline, signal_ms/signal_fraction (same schedule) and best_signal_fraction, from medians;
    the same from the fastest round (``*_min``: least disturbed by outside load); and ``*_paired``: the
    median over rounds of the per-round ratio (both runs of a ratio come from the same round).

    ``gap_closure`` = (t_baseline − t) / (t_baseline − t_signal), t_signal the configuration's own signal run
    (same schedule and delayed-W setting): the share of what communication costs the baseline that this
    configuration wins back (None where that gap is not positive). ``void``: the configuration is above 100 %
    of its own signal bound (median), which no correct measurement can be; a void number never counts."""
    by = {r["config"]: r for r in recs}
    base = by.get(baseline)
    sig_recs = [r for r in recs if r["strategy"] == "signal"]
    best = min((r["ms_per_iter"] for r in sig_recs), default=None)
    best_min = min((r.get("ms_min", r["ms_per_iter"]) for r in sig_recs), default=None)

    def paired(num: dict[str, Any] | None, den: dict[str, Any]) -> float | None:
        if num is None or not num.get("ms_all") or len(num["ms_all"]) != len(den.get("ms_all") or []):
            return None
        return statistics.median(a / b for a, b in zip(num["ms_all"], den["ms_all"]))

    for r in recs:
        r["baseline"] = baseline
        r["speedup_vs_baseline"] = base["ms_per_iter"] / r["ms_per_iter"] if base else None
        sig = by.get(BenchConfig(r["schedule"], "signal", r["delay_wgrad"]).name)
        r["signal_config"] = sig["config"] if sig else None
        r["signal_ms"] = sig["ms_per_iter"] if sig else None
        r["signal_fraction"] = sig["ms_per_iter"] / r["ms_per_iter"] if sig else None
        r["best_signal_fraction"] = best / r["ms_per_iter"] if best else None
        r["gap_closure"] = gap_closure(base["ms_per_iter"] if base else None, r["ms_per_iter"], r["signal_ms"])
        r["void"] = r["strategy"] != "signal" and r["signal_fraction"] is not None and r["signal_fraction"] > 1.0
        if "ms_min" in r:
            r["speedup_vs_baseline_min"] = base["ms_min"] / r["ms_min"] if base else None
            r["signal_fraction_min"] = sig["ms_min"] / r["ms_min"] if sig else None
            r["best_signal_fraction_min"] = best_min / r["ms_min"] if best_min else None
            r["speedup_vs_baseline_paired"] = paired(base, r)
            r["signal_fraction_paired"] = paired(sig, r)
    from lab.bench.physical_bound import fill

    fill(recs, baseline)  # physical_fraction, physical_gap_closure, physical_void
    for r in recs:
        r["void"] = r["void"] or (r["strategy"] != "signal" and r["physical_void"])


def gap_closure(t_baseline: float | None, t: float, t_signal: float | None) -> float | None:
    """(t_baseline − t) / (t_baseline − t_signal); None without both times or when the gap is not positive."""
    if t_baseline is None or t_signal is None or t_baseline - t_signal <= 0:
        return None
    return (t_baseline - t) / (t_baseline - t_signal)


# ---- simulate --------------------------------------------------------------------------------------
def costs_from_records(recs: Sequence[dict[str, Any]], pp: int, source: str = "records") -> dict[str, Any]:
    """Per-stage F/B/I/W ms of a measured run: a paced run's budgets (``pace_ms``: what each action costs
    its emulated device, the same for every configuration), else the median action_ms of the signal runs
    (no waiting inside F/B), else of any run. Kinds the run did not execute are None."""
    paced = next((r["pace_ms"] for r in recs if r.get("pace_ms")), None)
    if paced:
        return {k.lower(): ([b[k] for b in paced] if all(k in b for b in paced) else None) for k in "FBIW"}
    pool = [r for r in recs if r.get("strategy") == "signal" and r.get("action_ms")] or \
           [r for r in recs if r.get("action_ms")]
    if not pool:
        raise ValueError(f"{source} has neither pace_ms nor action_ms (per-action times of a measured run)")

    def per_stage(kind: str) -> list[float] | None:
        rows = [r["action_ms"][kind] for r in pool if kind in r["action_ms"]]
        if not rows:
            return None
        return [statistics.median(row[s] for row in rows if row[s] is not None) for s in range(pp)]

    return {k.lower(): per_stage(k) for k in "FBIW"}


def load_cost_records(path: str) -> list[dict[str, Any]]:
    """A run's records, or a grid JSON's first point that has records (every point shares its budgets)."""
    data = json.load(open(path))
    if isinstance(data, dict) and data.get("kind") == pipeline_grid.GRID_KIND:
        data = next((pt["records"] for pt in data["points"] if pt.get("records")), [])
    if not isinstance(data, list):
        raise ValueError(f"{path} is neither a list of records nor a grid JSON")
    return data


def _costs(a: argparse.Namespace, configs: Sequence[BenchConfig]) -> dict[str, Any]:
    """Per-stage F/B/I/W costs (ms): --cost-* win, else a measured run's (``costs_from_records``), else F=10, B=2F."""
    f = b = i = w = None
    if a.costs_from:
        m = costs_from_records(load_cost_records(a.costs_from), a.pp, a.costs_from)
        f, b, i, w = m["f"], m["b"], m["i"], m["w"]
    f = [a.cost_f] * a.pp if a.cost_f is not None else f or [10.0] * a.pp
    b = [a.cost_b] * a.pp if a.cost_b is not None else b or [2 * x for x in f]
    if a.cost_i is not None:
        i = [a.cost_i] * a.pp
    if a.cost_w is not None:
        w = [a.cost_w] * a.pp
    if i is None:
        i = [x / 2 for x in b]
    if w is None:
        w = [x - y for x, y in zip(b, i)]
    return {"f": f, "b": b, "i": i, "w": w}


def simulate_records(a: argparse.Namespace, configs: Sequence[BenchConfig], costs: dict[str, Any], world: int,
                     pph: int) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """Records (mode "simulated") and traces of every configuration under the simulator, each stage on its
    own device, every edge's transfer time from the network model at ``a.nic_gbps``."""
    from megareshard.pipeline import Costs, generate, simulate

    net = edge_transfer_model(a, configs, world, pph)
    ms, traces = [], []
    graph = None
    if a.model != "gpt":
        from megareshard.parallel import Topology

        cfg, spec = parse_model_config(a, configs[0], world)
        graph = spec.graph(cfg, spec.stage_layouts(cfg, Topology(world, tp=a.tp, pp=a.pp, nproc_per_node=pph)))
    for c in configs:
        sched = generate(c.schedule, a.pp, a.microbatches, delay_wgrad=c.dw, graph=graph)
        comm_ms = {k: 1e3 * v for k, v in net[c.strategy]["edge_s"].items()}
        tl = simulate(sched, costs=Costs(f=costs["f"], b=costs["b"], i=costs["i"], w=costs["w"], comm=comm_ms))
        ms.append([tl.makespan])
        traces.append([{**r, "start": r["start"] / 1e3, "end": r["end"] / 1e3} for r in tl.to_trace()])
    return make_records(a, configs, ms, traces, world, pph, mode="simulated", costs=costs), traces
