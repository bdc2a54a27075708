#!/usr/bin/env python3
"""Benchmark cross-mesh resharding strategies and schedulers (Zhuang et al., "On Optimizing the Communication
of Model Parallelism", MLSys 2023, §5.1; docs/design.md §7).

Three ways to run it:

    # no processes: the network model only
    python -m lab.bench.bench_resharding --simulate --suite paper --nic-gbps 1
    # on the emulated cluster (one network namespace per host, 1 Gbit/s NICs)
    python -m lab.cluster.emulate_cluster --hosts 5 --procs-per-host 2 --nic-rate 1gbit -- \
        -m lab.bench.bench_resharding --suite paper --scale 0.015625 --devices-per-host 2 --nic-gbps 1
    # plain torchrun (hosts are then only labels: every rank on one machine)
    torchrun --nproc-per-node 8 lab/bench/bench_resharding.py --case 1 --devices-per-host 2

A rank's host is `rank // LOCAL_WORLD_SIZE` (torchrun's node layout). Each case's
source mesh sits on the first hosts and its destination mesh on the next ones; a case
that needs more hosts or devices per host than the job has is skipped (and says so).
Ranks in neither mesh stay idle but take part in barriers.

`--order plan,concurrent` runs every configuration under both execution orders of the
`Resharder` (plan: one task at a time per host NIC side, in plan order, as the network
model assumes; concurrent: every task on the wire at once), back to back, so the two can
be compared inside one run.

Per (case, strategy, scheduler, order): build the plan and the `Resharder` (not timed), one
warm-up run whose output is checked against the expected values, then `--repeat` timed
runs, each between two barriers; the median is reported. Alongside: the model's NIC bytes
and lower bound at `--nic-gbps`, its prediction for the order that ran
(`NetworkModel.predict(plan, order)`) at the NIC goodput measured once before the cases
(`--calibrate-mb`: one message host 0 -> host 1; 0 = predict at `--nic-gbps`), and, inside
the emulated cluster, the bytes really counted on the hosts' eth0. Each broadcast task is
sent in the chunk count K the network model chooses for it (`NetworkModel.broadcast_chunks`
at the calibrated rate; `--chunks` fixes one K for all), printed in column K. Only rank 0 prints. Timings on an oversubscribed CPU
are noisy: compare ratios inside one run (docs/design.md §7).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence


import torch  # noqa: E402

from megareshard.resharding import (RESHARD_SCHEDULERS, Mesh, NetworkModel, ShardingSpec, local_slices,  # noqa: E402
                                    plan_resharding)
import lab.signal  # noqa: F401 (registers the `signal` bound these benchmarks run)
from megareshard.resharding.cases import PAPER_CASE_IDS, NamedCase, one_to_many_cases, paper_case  # noqa: E402

STRATEGIES = ("sendrecv", "allgather", "broadcast", "signal")


@dataclass
class Record:
    case: str
    strategy: str
    scheduler: str
    seconds: float
    nic_bytes: int
    lower_bound_s: float
    ratio_to_bound: float | None
    speedup_vs_sendrecv: float | None
    predicted_s: float
    scheduler_used: str = ""
    shape: list[int] = field(default_factory=list)
    mbytes: float = 0.0
    tasks: int = 0
    chunks: list[int] = field(default_factory=list)  # the broadcast chunk counts K of its tasks (distinct, ascending)
    repeats: list[float] = field(default_factory=list)
    measured_nic_bytes: int | None = None
    simulated: bool = False
    order: str = ""
    model_nic_gbps: float = 0.0  # the NIC rate `predicted_s` was computed with (calibrated: the measured goodput)


# ---------------------------------------------------------------------------- cases
def place(mesh: Mesh, procs_per_host: int) -> Mesh:
    """Put a case's mesh on the job's ranks: the k-th device of host h is rank h*P + k."""
    seen: dict[int, int] = {}
    pos: dict[int, int] = {}
    for r in mesh.flat_ranks:
        h = mesh.host_of(r)
        k = seen.get(h, 0)
        if k >= procs_per_host:
            raise ValueError(f"mesh {mesh!r} puts {k + 1} devices on host {h}; the job has {procs_per_host} per host")
        seen[h] = k + 1
        pos[r] = h * procs_per_host + k
    return Mesh([[pos[r] for r in row] for row in mesh.ranks], {pos[r]: mesh.host_of(r) for r in mesh.flat_ranks})


def build_cases(args: argparse.Namespace) -> list[NamedCase]:
    out: list[NamedCase] = []
    if args.shape:
        shape = tuple(int(s) for s in args.shape.split(","))
        src = Mesh.parse(args.src_mesh)
        dst = Mesh.parse(args.dst_mesh, first_rank=src.size, first_host=len(src.host_ids()))
        out.append(NamedCase(f"{args.src_mesh}:{args.src_spec}->{args.dst_mesh}:{args.dst_spec}", shape, src,
                             ShardingSpec.parse(args.src_spec), dst, ShardingSpec.parse(args.dst_spec)))
        return out
    if args.case:
        ids = [int(c) for c in args.case.split(",")]
    elif args.suite == "paper":
        ids = list(PAPER_CASE_IDS)
    else:
        ids = []
    for n in ids:
        c = paper_case(n, scale=args.scale, devices_per_host=args.devices_per_host)
        out.append(NamedCase(f"case{n}", *c))
    if args.suite == "one-to-many":
        names = set()
        for c in one_to_many_cases(scale=args.scale, max_devices=args.max_devices, max_hosts=args.max_hosts,
                                   devices_per_host=args.devices_per_host):
            if c.name in names:  # "1->1xD" is both the last one-host case and the first multi-host one
                continue
            names.add(c.name)
            out.append(c)
    return out


def fits(case: NamedCase, num_hosts: int, procs_per_host: int) -> str | None:
    """Why the case does not fit the job, or None."""
    hosts = set(case.src_mesh.host_ids()) | set(case.dst_mesh.host_ids())
    if max(hosts) >= num_hosts:
        return f"needs {max(hosts) + 1} hosts, the job has {num_hosts}"
    for m in (case.src_mesh, case.dst_mesh):
        for h in m.host_ids():
            if len(m.ranks_on_host(h)) > procs_per_host:
                return f"needs {len(m.ranks_on_host(h))} devices on host {h}, the job has {procs_per_host} per host"
    return None


# ---------------------------------------------------------------------------- data
def pattern(shape: Sequence[int], region: Sequence[slice], dtype: torch.dtype) -> torch.Tensor:
    """Values of `global[region]` for global = (linear index mod 65521), built locally.

    Exact in fp32 and cheap: the global tensor is never materialised.
    """
    idx = torch.zeros([s.stop - s.start for s in region], dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(shape))):
        view = [1] * len(shape)
        view[d] = -1
        idx += (torch.arange(region[d].start, region[d].stop, dtype=torch.int64) * stride).view(view)
        stride *= shape[d]
    return (idx % 65521).to(dtype)


# ---------------------------------------------------------------------------- measuring
def _nic_counters() -> tuple[int, int] | None:
    base = Path("/sys/class/net/eth0/statistics")
    try:
        return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())
    except OSError:
        return None


def calibrate_goodput(procs_per_host: int, num_hosts: int, nbytes: int, repeat: int = 3) -> float | None:
    """Bytes/s of one `nbytes` message from host 0 to host 1, median of `repeat` (collective).

    What a NIC really delivers to gloo (rate limiter, TCP/IP headers, copies), to predict with
    instead of the nominal rate; None with one host.
    """
    import torch.distributed as dist

    if num_hosts < 2 or nbytes <= 0:
        return None
    rank, a, b = dist.get_rank(), 0, procs_per_host
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32) if rank in (a, b) else None
    times = []
    for _ in range(repeat + 1):  # the first one opens the connection and grows the TCP window
        dist.barrier()
        t0 = time.perf_counter()
        if rank == a:
            dist.send(buf, dst=b)
        elif rank == b:
            dist.recv(buf, src=a)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return max(1, nbytes // 4) * 4 / statistics.median(times[1:])


def run_config(case: NamedCase, strategy: str, scheduler: str, args: argparse.Namespace,
               model: NetworkModel, procs_per_host: int, order: str = "concurrent",
               pred_model: NetworkModel | None = None) -> Record:
    """Plan, build, check, time one configuration (collective in distributed mode).

    `model` gives the NIC bytes and the lower bound (nominal rate); `pred_model` (default:
    `model`) the prediction.
    """
    pred_model = pred_model or model
    itemsize = torch.empty(0, dtype=args.torch_dtype).element_size()
    if args.simulate:
        src, dst = case.src_mesh, case.dst_mesh
    else:
        src, dst = place(case.src_mesh, procs_per_host), place(case.dst_mesh, procs_per_host)
    # `auto` plans for the order that runs; K per task from the model at the rate the NICs deliver
    plan = plan_resharding(case.shape, src, case.src_spec, dst, case.dst_spec, strategy=strategy,
                           scheduler=scheduler, itemsize=itemsize, time_budget_s=args.time_budget,
                           order="concurrent" if order == "concurrent" and not args.simulate else "plan",
                           broadcast_chunks=args.chunks, network=pred_model)
    host_bytes = model.host_bytes(plan)
    nic_bytes = sum(o for o, _ in host_bytes.values())
    lb = model.lower_bound(plan)
    # the prediction for the order the executor runs ("model" in --simulate: plan order)
    pred = pred_model.predict(plan, order="concurrent" if order == "concurrent" and not args.simulate else "plan")
    nbytes = 1
    for s in case.shape:
        nbytes *= s
    rec = Record(case=case.name, strategy=strategy, scheduler=scheduler, seconds=pred, nic_bytes=nic_bytes,
                 lower_bound_s=lb, ratio_to_bound=None, speedup_vs_sendrecv=None, predicted_s=pred,
                 scheduler_used=plan.scheduler, shape=list(case.shape), mbytes=nbytes * itemsize / 2**20,
                 tasks=len(plan.tasks), chunks=sorted({t.chunks for t in plan.tasks}), simulated=args.simulate,
                 order="model" if args.simulate else order, model_nic_gbps=pred_model.nic_gbps)
    if args.simulate:
        rec.ratio_to_bound = pred / lb if lb > 0 and strategy != "signal" else None
        return rec

    import torch.distributed as dist

    from megareshard.resharding.executor import Resharder

    rank = dist.get_rank()
    res = Resharder(plan, args.torch_dtype, order=order)
    src_sl = local_slices(case.shape, src, case.src_spec, rank)
    local = None if src_sl is None else pattern(case.shape, src_sl, args.torch_dtype)
    dist.barrier()
    out = res.run(local)  # warm-up, checked
    ok = True
    if strategy != "signal" and out is not None:
        ok = torch.equal(out, pattern(case.shape, local_slices(case.shape, dst, case.dst_spec, rank), out.dtype))
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    if flag.item():
        raise RuntimeError(f"{case.name} {strategy}/{scheduler} order={order}: {flag.item()} destination ranks "
                           f"got wrong values")
    before = _nic_counters() if rank % procs_per_host == 0 else None
    times = []
    for _ in range(args.repeat):
        dist.barrier()
        t0 = time.perf_counter()
        res.run(local)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    after = _nic_counters() if before is not None else None
    tx = torch.tensor([0 if before is None or after is None else after[0] - before[0]], dtype=torch.int64)
    have = torch.tensor([1 if before is not None and after is not None else 0])
    dist.all_reduce(tx)
    dist.all_reduce(have)
    rec.repeats = times
    rec.seconds = statistics.median(times)
    if args.trace_dir:
        traced_run(args, plan, local, rec, src, dst)
    rec.ratio_to_bound = rec.seconds / lb if lb > 0 and strategy != "signal" else None  # signal: 1 B/task
    hosts_used = len(set(src.host_ids()) | set(dst.host_ids()))
    if have.item() >= hosts_used:
        rec.measured_nic_bytes = int(tx.item()) // args.repeat
    return rec


def traced_run(args: argparse.Namespace, plan: Any, local: torch.Tensor | None, rec: Record, src: Mesh,
               dst: Mesh) -> None:
    """One more run of `plan`, traced (collective); rank 0 writes the timeline with what explains it: each task's
    bytes, sender and receivers, the ranks' hosts, the run's time beside the median untraced one and the bound.
    The ranks share one clock (CLOCK_MONOTONIC) only where they share a machine, as on the emulated cluster."""
    import torch.distributed as dist

    from megareshard.resharding.executor import Resharder

    res = Resharder(plan, args.torch_dtype, order=rec.order, trace=True)
    dist.barrier()
    t0 = time.perf_counter()
    handle = res.start(local)
    handle.wait()
    dist.barrier()
    traced_s = time.perf_counter() - t0
    events: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(events, handle.trace)
    if dist.get_rank() != 0:
        return
    hosts = {r: src.host_of(r) for r in src.flat_ranks}
    hosts.update({r: dst.host_of(r) for r in dst.flat_ranks})
    doc = {"case": rec.case, "strategy": rec.strategy, "scheduler": rec.scheduler,
           "scheduler_used": rec.scheduler_used, "order": rec.order,
           "seconds_median_untraced": rec.seconds, "seconds_traced": traced_s, "lower_bound_s": rec.lower_bound_s,
           "predicted_s": rec.predicted_s, "nic_gbps": args.nic_gbps, "host_of_rank": hosts,
           "tasks": [{"pos": pos, "task": t.index, "bytes": t.nbytes, "sender": t.sender,
                      "receivers": list(t.receivers), "chunks": t.chunks} for pos, t in enumerate(plan.tasks)],
           "events": sorted((e for per in events for e in per), key=lambda e: e["t_post"])}
    os.makedirs(args.trace_dir, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9.+-]+", "_", f"{rec.case}_{rec.strategy}_{rec.scheduler}_{rec.order}")
    path = Path(args.trace_dir, f"{name}.json")
    path.write_text(json.dumps(doc, indent=1))
    print(f"# traced run: {path} ({traced_s:.4f}s traced, {rec.seconds:.4f}s untraced median)", flush=True)


# ---------------------------------------------------------------------------- reporting
def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _fmt_chunks(chunks: list[int]) -> str:
    """The broadcast chunk counts of a plan's tasks: `16`, or `1-16` when they differ."""
    if not chunks:
        return "-"
    return str(chunks[0]) if len(chunks) == 1 else f"{chunks[0]}-{chunks[-1]}"


def table(records: list[Record]) -> str:
    rows = [("strategy", "scheduler", "used", "order", "K", "time s", "NIC MB", "meas MB", "bound s", "ratio",
             "vs sendrecv", "pred s", "pred/meas")]
    for r in records:
        rows.append((r.strategy, r.scheduler, r.scheduler_used, r.order, _fmt_chunks(r.chunks), _fmt(r.seconds, ".4f"),
                     _fmt(r.nic_bytes / 1e6, ".1f"),
                     _fmt(None if r.measured_nic_bytes is None else r.measured_nic_bytes / 1e6, ".1f"),
                     _fmt(r.lower_bound_s, ".4f"), _fmt(r.ratio_to_bound, ".2f"),
                     _fmt(r.speedup_vs_sendrecv, ".2f") + ("x" if r.speedup_vs_sendrecv else ""),
                     _fmt(r.predicted_s, ".4f"), _fmt(r.predicted_s / r.seconds if r.seconds else None, ".2f")))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def fill_speedups(records: list[Record]) -> None:
    base = {(r.case, r.scheduler, r.order): r.seconds for r in records if r.strategy == "sendrecv"}
    for r in records:
        b = base.get((r.case, r.scheduler, r.order))
        ok = b and r.seconds > 0 and r.strategy != "signal"  # signal moves no data: no speedup to speak of
        r.speedup_vs_sendrecv = b / r.seconds if ok else None


def markdown(records: list[Record]) -> str:
    """The records as the markdown table of docs/benchmarks.md."""
    head = ("| case | strategy | scheduler (used) | order | K | time s | NIC MB (model / measured) | bound s | ratio "
            "| vs sendrecv | predicted s | pred/meas |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in records:
        meas = "-" if r.measured_nic_bytes is None else f"{r.measured_nic_bytes / 1e6:.1f}"
        lines.append(f"| {r.case} | {r.strategy} | {r.scheduler} ({r.scheduler_used}) | {r.order} "
                     f"| {_fmt_chunks(r.chunks)} | {r.seconds:.3f} "
                     f"| {r.nic_bytes / 1e6:.1f} / {meas} | {r.lower_bound_s:.3f} | {_fmt(r.ratio_to_bound, '.2f')} "
                     f"| {_fmt(r.speedup_vs_sendrecv, '.2f')}{'x' if r.speedup_vs_sendrecv else ''} "
                     f"| {r.predicted_s:.3f} | {_fmt(r.predicted_s / r.seconds if r.seconds else None, '.2f')} |")
    return "\n".join(lines)


def plot(records: list[Record], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed; no plot written to {path}")
        return
    cases = list(dict.fromkeys(r.case for r in records))
    strategies = [s for s in STRATEGIES if any(r.strategy == s for r in records)]
    schedulers = list(dict.fromkeys(r.scheduler for r in records))
    orders = list(dict.fromkeys(r.order for r in records))
    main_sched = "auto" if "auto" in schedulers else schedulers[-1]
    panels = []
    for order in orders:
        panels.append(("strategy", main_sched, strategies, order))
        if len(schedulers) > 1:
            strat = "broadcast" if "broadcast" in strategies else strategies[0]
            panels.append(("scheduler", strat, schedulers, order))
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 1.3 * len(cases)), 3.6 * len(panels)), squeeze=False)
    ymax = max(r.seconds for r in records) * 1.05
    for ax, (kind, fixed, series, order) in zip(axes[:, 0], panels):
        width = 0.8 / max(1, len(series))
        for k, s in enumerate(series):
            xs, ys = [], []
            for i, c in enumerate(cases):
                match = [r for r in records if r.case == c and r.order == order and
                         ((r.strategy, r.scheduler) == (s, fixed) if kind == "strategy" else (r.strategy, r.scheduler) == (fixed, s))]
                if match:
                    xs.append(i + (k - (len(series) - 1) / 2) * width)
                    ys.append(match[0].seconds)
            ax.bar(xs, ys, width, label=s)
        lbs = []
        for i, c in enumerate(cases):
            match = [r.lower_bound_s for r in records if r.case == c and r.strategy == "broadcast"] or \
                    [r.lower_bound_s for r in records if r.case == c]
            lbs.append(min(match))
        ax.scatter(range(len(cases)), lbs, marker="_", s=600, color="black", zorder=3, label="NIC lower bound")
        ax.set_xticks(range(len(cases)), cases)
        ax.set_ylim(0, ymax)
        ax.set_ylabel("seconds (median)")
        other = "scheduler" if kind == "strategy" else "strategy"
        ax.set_title(f"{title}, order={order}: by {kind} ({other} = {fixed})")
        ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}")


# ---------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--case", help="paper case number(s), comma-separated (1..9)")
    what.add_argument("--suite", choices=("paper", "one-to-many"), help="all paper cases, or the 1->M cases")
    what.add_argument("--shape", help="explicit global shape, e.g. 1024,1024,512 (with --src-mesh etc.)")
    ap.add_argument("--src-mesh", default="2x4")
    ap.add_argument("--src-spec", default="S0,R,R")
    ap.add_argument("--dst-mesh", default="2x4")
    ap.add_argument("--dst-spec", default="S0,R,R")
    ap.add_argument("--strategy", default="sendrecv,allgather,broadcast")
    ap.add_argument("--scheduler", default="naive,auto")
    ap.add_argument("--chunks", type=int, default=None,
                    help="broadcast pipeline chunks K for every task (default: the network model's choice per task)")
    ap.add_argument("--order", default=None,
                    help="Resharder execution order(s), comma-separated: plan, concurrent (default: the executor's)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the paper's tensor size by this")
    ap.add_argument("--devices-per-host", type=int, default=4)
    ap.add_argument("--procs-per-host", type=int, default=None,
                    help="ranks per host (default: torchrun's LOCAL_WORLD_SIZE); on one machine, hosts as labels")
    ap.add_argument("--max-devices", type=int, default=4, help="one-to-many: up to this many devices on one host")
    ap.add_argument("--max-hosts", type=int, default=4, help="one-to-many: up to this many receiving hosts")
    ap.add_argument("--nic-gbps", type=float, default=1.0, help="NIC bandwidth for the model (each way)")
    ap.add_argument("--intra-gbps", type=float, default=100.0, help="intra-host bandwidth for the model")
    ap.add_argument("--calibrate-mb", type=float, default=32.0,
                    help="before the cases, time one message of this many MiB from host 0 to host 1 and predict "
                         "with that goodput instead of --nic-gbps (the lower bound stays nominal); 0: off")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "float64"))
    ap.add_argument("--time-budget", type=float, default=0.5, help="dfs time budget per plan, seconds")
    ap.add_argument("--simulate", action="store_true", help="no processes: model predictions only")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--plot", help="write a bar chart here (PNG; needs matplotlib)")
    ap.add_argument("--markdown", help="write the results as a markdown table here")
    ap.add_argument("--trace-dir", default=None,
                    help="after each configuration's timed runs, one more run traced (gloo; every wire operation's "
                         "post and completion, lab/bench/reshard_timeline.py draws it): CASE_STRATEGY_SCHEDULER_ORDER"
                         ".json here (other characters as _); the timed runs are not traced")
    args = ap.parse_args(argv)
    if not (args.case or args.suite or args.shape):
        ap.error("say what to run: --case N, --suite paper|one-to-many, or --shape with the meshes/specs")
    args.strategies = [s.strip() for s in args.strategy.split(",") if s.strip()]
    args.schedulers = [s.strip() for s in args.scheduler.split(",") if s.strip()]
    for s in args.strategies:
        if s not in STRATEGIES:
            ap.error(f"unknown strategy {s!r}; allowed: {', '.join(STRATEGIES)}")
    for s in args.schedulers:
        if s not in RESHARD_SCHEDULERS:
            ap.error(f"unknown scheduler {s!r}; registered: {', '.join(RESHARD_SCHEDULERS.names())}")
    from megareshard.resharding.messages import DEFAULT_ORDER, ORDERS

    args.orders = [o.strip() for o in (args.order or DEFAULT_ORDER).split(",") if o.strip()]
    for o in args.orders:
        if o not in ORDERS:
            ap.error(f"unknown order {o!r}; allowed: {', '.join(ORDERS)}")
    if args.simulate:
        args.orders = ["model"]  # the network model: list scheduling in plan order
    if args.repeat < 1 or (args.chunks is not None and args.chunks < 1) or args.scale <= 0:
        ap.error(f"--repeat ({args.repeat}) and --chunks ({args.chunks}) must be >= 1, --scale ({args.scale}) > 0")
    args.torch_dtype = getattr(torch, args.dtype)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = NetworkModel(args.nic_gbps, args.intra_gbps)
    rank, world, procs_per_host = 0, 1, 1
    if not args.simulate:
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        procs_per_host = args.procs_per_host or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world % procs_per_host:
            raise SystemExit(f"bench_resharding: {world} ranks are not divisible by {procs_per_host} per host")
    num_hosts = max(1, world // procs_per_host)
    say = print if rank == 0 else (lambda *a, **k: None)
    cases = build_cases(args)
    mode = "simulated (network model only)" if args.simulate else \
        f"{world} ranks = {num_hosts} hosts x {procs_per_host} (gloo)"
    say(f"# bench_resharding: {mode}; model NIC {args.nic_gbps} Gbit/s, intra {args.intra_gbps} Gbit/s; "
        f"dtype {args.dtype}; chunks {args.chunks or 'per task (model)'}; repeat {args.repeat}; order {','.join(args.orders)}")
    if args.scale != 1.0:
        say(f"# tensor scaled by {args.scale} from the paper's size (one dim replicated in both specs shrinks)")
    pred_model = model
    if not args.simulate and args.calibrate_mb > 0:
        goodput = calibrate_goodput(procs_per_host, num_hosts, int(args.calibrate_mb * 2**20))
        if goodput is None:
            say("# calibration skipped: one host; predictions use the nominal --nic-gbps")
        else:
            pred_model = NetworkModel(goodput * 8 / 1e9, args.intra_gbps)
            say(f"# calibrated: one {args.calibrate_mb:g} MiB message host 0 -> host 1 at "
                f"{goodput * 8 / 1e6:.0f} Mbit/s = {goodput * 8 / 1e9 / args.nic_gbps:.3f} of the nominal "
                f"{args.nic_gbps:g} Gbit/s; predictions use it, lower bounds stay nominal")
    runnable = []
    for c in cases:
        why = None if args.simulate else fits(c, num_hosts, procs_per_host)
        if why:
            say(f"# skipped {c.name}: {why}")
        else:
            runnable.append(c)
    # orders innermost: the two executions of one plan run back to back (comparable under drifting load)
    configs = [(c, st, sc, o) for c in runnable for st in args.strategies for sc in args.schedulers
               for o in args.orders]
    records: list[Record] = []
    t_start = time.monotonic()
    for i, (c, st, sc, o) in enumerate(configs, 1):
        rec = run_config(c, st, sc, args, model, procs_per_host, o, pred_model)
        records.append(rec)
        say(f"[{i}/{len(configs)} {time.monotonic() - t_start:6.1f}s] {c.name} {st}/{sc}({rec.scheduler_used}) "
            f"{rec.order} K={_fmt_chunks(rec.chunks)}: "
            f"{rec.seconds:.4f}s (bound {rec.lower_bound_s:.4f}s, predicted {rec.predicted_s:.4f}s)", flush=True)
    fill_speedups(records)
    for c in runnable:
        recs = [r for r in records if r.case == c.name]
        say(f"\n## {c.name}: shape {tuple(c.shape)} ({recs[0].mbytes:.1f} MiB), {c.src_mesh} {c.src_spec} -> "
            f"{c.dst_mesh} {c.dst_spec}, {recs[0].tasks} unit tasks")
        say(table(recs))
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in records], indent=1))
        say(f"\nrecords written to {args.json}")
    if rank == 0 and args.markdown:
        Path(args.markdown).write_text(markdown(records) + "\n")
        say(f"markdown table written to {args.markdown}")
    if rank == 0 and args.plot and records:
        plot(records, args.plot, "simulated" if args.simulate else f"{num_hosts} hosts x {procs_per_host}")
    if not args.simulate:
        import torch.distributed as dist

        from megareshard.resharding.executor import CommStreams

        dist.barrier()
        # every resharder's stream threads stopped and joined, their communicators destroyed, before the process
        # group goes: a stream thread still alive at interpreter exit can be killed inside a C++ call (SIGABRT)
        CommStreams.shared().close(destroy_groups=True)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
