#!/usr/bin/env python
"""megareshard's pipeline schedules against torch.distributed.pipelining's, side by side in one launch.

    # the grid (the lead runs it alone): the operating points of grid_points.PEER_POINTS, 4 emulated hosts (root);
    # writes docs/results/peers_pp4.json and docs/img/peers_pp4.png, prints Markdown tables
    python -m lab.bench.bench_peers --grid
    python -m lab.bench.bench_peers --grid --dry-run        # each point's command and a wall-time estimate only
    python -m lab.bench.bench_peers --from-json docs/results/peers_pp4.json [--plot X.png]   # redraw
    # one point by hand
    python -m lab.cluster.emulate_cluster --hosts 4 --procs-per-host 2 --nic-rate 40mbit -- \
        -m lab.bench.bench_peers --tp 2 --pp 4 --nic-gbps 0.04 --pace auto --json out.json --plot out.png
    # plain torchrun on this machine (a smoke run; no rate limit)
    python -m lab.bench.bench_peers --tp 1 --pp 4 --iters 2 --warmup 1

Participants. megareshard: every registered schedule (``megareshard.pipeline.schedule_names()``): one
stage per rank, or virtual stages (``interleaved-1f1b`` and ``eager-interleaved-1f1b`` with 2 chunks per
rank, ``--num-virtual-stages-per-pipeline-rank 2``; ``zbv``, which always splits I/W: ``zbv+…+dw``), each
with ``allgather`` (the Megatron-style baseline) and ``broadcast`` (its best strategy), the full method
``eager-1f1b+broadcast+dw``, and a ``signal`` run (1-byte transfers: the upper bound of what
communication can cost) per (schedule, delayed W). The worker builds one ``Trainer`` per distinct stage
placement among them (same seed: chunks keep the model's parameter names, so the same initial weights);
every configuration of a placement runs on that trainer's model. torch: every schedule of
``peers_torch.PEER_SCHEDULES`` (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleLoopedBFS,
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV); one that cannot be built or
cannot step here is reported "failed" with its reason (each runs on pipeline groups of its own with a
short timeout, so a peer that hangs fails alone).

Same model, same arithmetic: one ``GPTModel`` configuration (untied output layer, no dropout), the same
batch and seed; torch's stages are ``GPTModel`` chunks (``layer_range``) of the same layers, the loss is
ours. Every participant's loss on the first step is compared with the baseline's (``loss - ref``; the
tolerance 2·m·2⁻²⁴·|loss| is the reordering of the m per-microbatch fp32 terms — everything else is the
same kernels on the same tensors). Parameters are not updated (no optimizer step is timed or run):
an iteration is the forward and backward of every microbatch plus the gradient reductions.

Method (as lab/bench/bench_pipeline.py): rounds interleave the participants (round r runs one iteration of
each), an iteration is timed from a barrier to the end of its backward, max over ranks; the median of
``--iters`` timed rounds after ``--warmup`` unpaced rounds is reported. ``--pace auto`` calibrates per
stage F/B/I/W budgets on megareshard's warm-up traces (``pacing.calibrate_pace``) and pads every compute
action of every participant to them (torch's: ``peers_torch.pace_stage``; a chunk holding a share of a
rank's layers gets that share of the budget, ``peers_torch.chunk_share``, megareshard's chunks too, and
its traced durations count in the calibration scaled back to a whole stage's). Per participant: ms/iteration, throughput ratio to
torch's best and to the baseline, fraction of the signal bound (megareshard), bubble fraction per stage
(measured idle / iteration span, last timed round), peak saved-activation bytes per stage
(``peers_torch.LifetimeMeter`` over the last warm-up round) and the simulator's prediction
(``megareshard.pipeline.simulate`` with the paced budgets and the network model's transfer times,
virtual-stage kinds on their chunks per rank;
torch's schedules through the registry schedule with the same order, where there is one) and the
**physical bound** (``physical_bound.py``: every rank's compute, every NIC side's bytes ÷ its rate, the
fill-and-drain critical path; torch's copies priced as ``sendrecv``). A result faster than its physical
bound (which includes the compute bound, ``peers_report.compute_bound_ms``) or than its own signal run is
void and never counts as best. ``--grid`` runs the operating points ``--points`` (default
``grid_points.PEER_POINTS``, chosen with ``--choose-points`` before running); ``--trace-dir`` writes both
sides' timelines of the last timed round.

Files: this one (arguments, the grid, redraws), ``peers_worker.py`` (the launch on every rank),
``peers_torch.py`` (torch's stages, pacing wrappers, the activation meter), ``peers_report.py``
(ratios, void rule, tables, pictures: pure).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from typing import Sequence

from lab import env_with_root, module_command
from lab.bench import bench_pipeline as bp  # GRID_RATES, rate parsing, the grid point runner
from lab.bench import peers_report as rep
from lab.bench.peers_worker import METHOD, our_configs, predict, run_worker, virtual_stages_of  # torch: lazily

ENV_ARGV = "MR_BENCH_PEERS_ARGV"
# the grid: few participants and rounds (paced compute repeats to within a few %): 10 points in about 21 min
GRID_DEFAULTS = {"iters": 3, "warmup": 1, "pace": "auto", "strategies": "broadcast"}
RUN_DEFAULTS = {"iters": 5, "warmup": 2, "pace": "none", "strategies": "allgather,broadcast"}
GRID_SETUP_S = 45.0  # start-up of one point: torchrun on 4 namespaces, every runtime, every peer's probe step


def build_parser() -> argparse.ArgumentParser:
    from lab.bench.peers_torch import PEER_SCHEDULES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=8, help="2 per rank per chunk at pp 4 with two chunks")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64,
                   help="with hidden 128, micro batch 2: a 0.52 Mbit activation, 52 ms at 10 Mbit/s (NIC-bound) "
                        "and 3 ms at 160 Mbit/s (compute-bound)")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--strategies", default=None,
                   help="megareshard strategies per schedule (default allgather,broadcast; --grid: broadcast); "
                        "1f1b+allgather, the baseline, always runs")
    p.add_argument("--schedules", default=None, help="megareshard schedules (default: every runtime schedule)")
    p.add_argument("--no-method", action="store_true", help=f"leave out {METHOD}")
    p.add_argument("--peers", default=",".join(PEER_SCHEDULES), help="torch schedules (comma list)")
    p.add_argument("--peer-timeout", type=float, default=120.0,
                   help="seconds a peer's pipeline operation may block before that peer is reported failed")
    p.add_argument("--reshard-scheduler", default="auto")
    p.add_argument("--reshard-chunks", type=int, default=None)
    p.add_argument("--recv-posting", default=None, choices=("auto", "early", "grouped", "mixed"),
                   help="--pipeline-recv-posting of megareshard's configurations (default: the runtime's, auto)")
    p.add_argument("--iters", type=int, default=None, help="timed rounds (default 5; --grid 3)")
    p.add_argument("--warmup", type=int, default=None, help="unpaced rounds first (default 2; --grid 1)")
    p.add_argument("--pace", default=None, help="'none' (default), 'auto' (--grid default) or 'F=..,B=..,I=..,W=..' ms")
    p.add_argument("--pace-quantile", type=float, default=0.9)
    p.add_argument("--pace-margin", type=float, default=1.25)
    p.add_argument("--nic-gbps", type=float, default=1.0, help="the emulated NIC rate (network model, simulator)")
    p.add_argument("--procs-per-host", type=int, default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG: bars per participant and peak activations per stage")
    p.add_argument("--from-json", default=None, help="no run: redraw the tables (and --plot) of a run or grid JSON")
    p.add_argument("--trace-dir", default=None,
                   help="write every participant's measured timeline of the last timed round here (NAME.json, both "
                        "sides: megareshard's actions and sends, torch's paced compute)")
    p.add_argument("--timeout", type=float, default=900.0, help="plain torchrun launch: kill after this long")
    g = p.add_argument_group("grid")
    g.add_argument("--grid", action="store_true", help="every --points point on the emulated cluster")
    g.add_argument("--points", default=None,
                   help="operating points RATE:tp=TP[:m=MICROBATCHES][:seq=SEQ_LENGTH], comma list (default: "
                        "grid_points.PEER_POINTS, chosen with --choose-points before running; with --choose-points: "
                        "the candidates, default grid_points.PEER_CANDIDATES)")
    g.add_argument("--rates", default=None, help="instead of --points: NIC rates, Mbit/s, at every --grid-tp")
    g.add_argument("--grid-tp", default="1,2", help="with --rates: tensor-parallel sizes (4 hosts × tp ranks)")
    g.add_argument("--choose-points", action="store_true",
                   help="no run: the simulator's prediction at every candidate point (the baseline's physical "
                        "bound and fraction of it, our best and torch's best, the point's wall time)")
    g.add_argument("--dry-run", action="store_true", help="--grid: commands and a wall-time estimate only")
    g.add_argument("--point-timeout", type=float, default=420.0,
                   help="stop a point after this many seconds (it is reported as stopped)")
    g.add_argument("--results", default="docs/results/peers_pp4.json")
    g.add_argument("--picture", default="docs/img/peers_pp4.png")
    return p


def resolve(a: argparse.Namespace) -> argparse.Namespace:
    for k, v in (GRID_DEFAULTS if a.grid else RUN_DEFAULTS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    # the fields bench_pipeline's helpers read
    a.model, a.num_layers_per_stage, a.baseline = "gpt", None, rep.BASELINE
    if a.iters < 1 or a.warmup < 1 or a.microbatches < 1:
        raise ValueError("--iters >= 1, --warmup >= 1 (the memory round and the calibration are warm-up rounds), "
                         "--microbatches >= 1")
    if a.num_layers % (2 * a.pp):
        raise ValueError(f"--num-layers {a.num_layers} must split into 2 chunks per rank on pp {a.pp} "
                         f"(a multiple of {2 * a.pp}) for the peers' interleaved and V schedules")
    return a


# ---- grid -------------------------------------------------------------------------------------------
WORKER_DESTS = ("tp", "pp", "num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                "microbatches", "vocab_size", "strategies", "schedules", "no_method", "peers", "peer_timeout",
                "reshard_scheduler", "reshard_chunks", "recv_posting", "iters", "warmup", "pace", "pace_quantile",
                "pace_margin")


def point_command(p: argparse.ArgumentParser, a: argparse.Namespace, rate: float, tp: int, out: str) -> list[str]:
    argv: list[str] = []
    for act in p._actions:
        v = getattr(a, act.dest, None)
        if act.dest not in WORKER_DESTS or v is None or v is False or act.dest == "tp":
            continue
        argv += [act.option_strings[-1]] if v is True else [act.option_strings[-1], str(v)]
    return (module_command("lab.cluster.emulate_cluster", ["--hosts", str(a.pp), "--procs-per-host", str(tp),
             "--nic-rate", f"{round(rate * 1e3)}kbit", "--timeout", f"{a.point_timeout:g}", "--",
             "-m", "lab.bench.bench_peers"]) + argv
            + ["--tp", str(tp), "--nic-gbps", f"{rate / 1e3:g}", "--procs-per-host", str(tp), "--json", out])


def estimate_point_s(a: argparse.Namespace, rate: float, tp: int) -> float:
    """Wall seconds of one point: every participant's simulated iteration (F=10, B=20 ms per stage, or the
    budgets of --estimate-from) for every round, plus the set-up."""
    from lab.bench.peers_torch import PEER_SCHEDULES

    pa = copy.copy(a)
    pa.tp, pa.nic_gbps = tp, rate / 1e3
    configs, _ = our_configs(pa)
    recs = [{"name": c.name, "framework": "megareshard", "status": "ok", "schedule": c.schedule,
             "strategy": c.strategy, "delay_wgrad": c.dw, "virtual_stages": virtual_stages_of(c.schedule)}
            for c in configs]
    peers = [s.strip() for s in a.peers.split(",") if s.strip()]
    recs += [{"name": f"torch {n}", "framework": "torch", "status": "ok", "schedule": f"torch {n}",
              "strategy": "p2p", "delay_wgrad": None} for n in peers if n in PEER_SCHEDULES]
    budgets = None
    if a.estimate_from:
        budgets = rep.load_json(a.estimate_from).get("budgets_ms")
        if not budgets or len(budgets) != a.pp:
            raise ValueError(f"--estimate-from {a.estimate_from}: no paced budgets for {a.pp} stages in it")
    predict(pa, recs, budgets, tp * a.pp, tp)
    known = [r["predicted_ms"] for r in recs if r["predicted_ms"]]
    mean = sum(known) / len(known) if known else 0.0
    per_round = sum(r["predicted_ms"] or mean for r in recs) / 1e3
    rounds = a.warmup + (1 if a.pace == "auto" else 0) + a.iters + 1  # + the peers' probe step
    return GRID_SETUP_S + rounds * per_round


def grid_points_of(a: argparse.Namespace) -> list[dict]:
    """The grid's points: --rates × --grid-tp, else --points, else grid_points.PEER_POINTS; each with its tp."""
    from lab.bench.grid_points import PEER_POINTS, parse_points, point_label

    if a.rates:
        pts = parse_points(",".join(f"{r:g}:tp={tp}" for tp in (int(x) for x in a.grid_tp.split(",") if x.strip())
                                    for r in bp.parse_rates(a.rates)))
        for pt in pts:
            pt["tp"] = pt["overrides"].pop("tp")
            pt["label"] = point_label(pt["rate_mbit"], pt["overrides"])
        return pts
    pts = parse_points(a.points or PEER_POINTS)
    for pt in pts:
        pt["tp"] = pt["overrides"].pop("tp", a.tp)
        pt["label"] = point_label(pt["rate_mbit"], pt["overrides"])
    return pts


def _point_args(a: argparse.Namespace, pt: dict) -> argparse.Namespace:
    from lab.bench.grid_points import apply_point

    pa = apply_point(a, pt)
    pa.tp = pt.get("tp", pt["overrides"].get("tp", a.tp))
    return pa


def _choose_points(a: argparse.Namespace) -> int:
    """--choose-points: per candidate, what the simulator predicts at the committed grid's budgets."""
    from lab.bench.grid_points import PEER_CANDIDATES, PEER_POINTS, classify, parse_points, reference_costs
    from lab.bench.peers_torch import PEER_SCHEDULES

    chosen = {pt["text"] for pt in parse_points(PEER_POINTS)}
    cands = parse_points(a.points or PEER_CANDIDATES)
    head = ["point (Mbit/s)", "baseline ms", "baseline physical bound ms (binding)", "baseline of physical",
            "our best (predicted)", "torch best (predicted)", "ratio", "best physically possible ratio", "kind",
            "point wall min", "in the grid"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for pt in cands:
        tp = pt["overrides"].pop("tp", a.tp)
        pt["tp"] = tp
        pa = _point_args(a, pt)
        costs, _ = reference_costs(a.results, a.pp, tp)
        budgets = [{k: costs[k.lower()][s] for k in "FBIW"} for s in range(a.pp)]
        configs, _ = our_configs(pa)
        recs = [{"name": c.name, "framework": "megareshard", "status": "ok", "schedule": c.schedule,
                 "strategy": c.strategy, "delay_wgrad": c.dw, "virtual_stages": virtual_stages_of(c.schedule),
                 "signal_name": c.signal.name if c.strategy != "signal" else None} for c in configs]
        recs += [{"name": f"torch {n}", "framework": "torch", "status": "ok", "schedule": n,
                  "strategy": "p2p", "delay_wgrad": None} for n in PEER_SCHEDULES]
        predict(pa, recs, budgets, tp * a.pp, tp)
        for r in recs:
            r["ms_per_iter"] = r["predicted_ms"] or float("inf")
        summary = rep.fill_ratios([dict(r, ms_q1=0, ms_q3=0) for r in recs], None)
        by = {r["name"]: r for r in recs}
        base = dict(by[rep.BASELINE])
        base["physical_fraction"] = (base["physical"]["bound_ms"] / base["ms_per_iter"]) if base.get("physical") else None
        ours = min((r for r in recs if r["framework"] == "megareshard" and r["strategy"] != "signal"),
                   key=lambda r: r["ms_per_iter"])
        torch_best = min((r for r in recs if r["framework"] == "torch" and r["predicted_ms"]),
                         key=lambda r: r["ms_per_iter"])
        wall = estimate_point_s(pa, pt["rate_mbit"], tp)
        pb = base.get("physical") or {}
        print("| " + " | ".join([
            pt["label"] + ("" if "tp" in pt["label"] else f" tp {tp}"), f"{base['ms_per_iter']:.0f}", f"{pb.get('bound_ms', 0):.0f} ({pb.get('binding')})",
            f"{base['physical_fraction']:.0%}", f"{ours['name']} {ours['ms_per_iter']:.0f}",
            f"{torch_best['name']} {torch_best['ms_per_iter']:.0f}",
            f"{torch_best['ms_per_iter'] / ours['ms_per_iter']:.2f}x",
            "-" if summary.get("physical_best_ratio") is None else f"{summary['physical_best_ratio']:.2f}x",
            classify(base), f"{wall / 60:.1f}", "yes" if pt["text"] in chosen else ""]) + " |", flush=True)
    return 0


def _grid(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    import tempfile

    points = grid_points_of(a)
    if a.dry_run:
        total = 0.0
        for pt in points:
            pa = _point_args(a, pt)
            est = estimate_point_s(pa, pt["rate_mbit"], pt["tp"])
            total += est
            print(f"# tp {pt['tp']}, {pt['label']} Mbit/s: about {est / 60:.1f} min")
            print(" ".join(point_command(p, pa, pt["rate_mbit"], pt["tp"], f"peers-{pt['tp']}-{pt['text']}.json")))
        print(f"# whole grid: about {total / 60:.0f} min")
        return 0
    from lab.cluster.emulate_cluster import check_privileges

    check_privileges()
    grid = {"kind": rep.GRID_KIND, "rates_mbit": sorted({pt["rate_mbit"] for pt in points}),
            "tps": sorted({pt["tp"] for pt in points}), "pp": a.pp, "picture": a.picture,
            "command": " ".join(["python -m lab.bench.bench_peers"] + sys.argv[1:]),
            "points": [{"rate_mbit": pt["rate_mbit"], "tp": pt["tp"], "label": pt["label"], "overrides": pt["overrides"],
                        "status": "not run", "reason": None, "run": None} for pt in points]}
    os.makedirs(os.path.dirname(a.results) or ".", exist_ok=True)
    os.makedirs(os.path.dirname(a.picture) or ".", exist_ok=True)
    t_grid = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-peers-grid-") as tmp:
        for k, (pt, gp) in enumerate(zip(points, grid["points"])):
            out = os.path.join(tmp, f"{k}.json")
            cmd = point_command(p, _point_args(a, pt), pt["rate_mbit"], pt["tp"], out)
            print(f"[bench_peers] grid point {k + 1}/{len(grid['points'])} (tp {pt['tp']}, {pt['label']} "
                  f"Mbit/s, {time.monotonic() - t_grid:.0f}s so far): {' '.join(cmd)}", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            try:
                rc, reason = bp._run_point(cmd, a.point_timeout)
            except KeyboardInterrupt:
                gp.update(status="stopped", reason="interrupted (Ctrl-C)")
                rep.write_json(a.results, grid)
                return 130
            run = json.load(open(out)) if os.path.exists(out) else None
            ok = rc == 0 and run is not None and run.get("status") == "complete"
            gp.update(status="complete" if ok else "stopped", run=run, wall_s=round(time.monotonic() - t0, 1),
                      reason=None if ok else (reason or f"exit code {rc}"))
            rep.write_json(a.results, grid)  # after every point: a stopped grid keeps what it ran
    print(rep.format_grid(grid), flush=True)
    rep.plot_grid(grid, a.picture)
    print(f"[bench_peers] grid: {a.results}, {a.picture} ({time.monotonic() - t_grid:.0f}s)", file=sys.stderr)
    return 0


def _replay(a: argparse.Namespace) -> int:
    data = rep.load_json(a.from_json)
    if data["kind"] == rep.GRID_KIND:
        print(rep.format_grid(data))
        for pt in data["points"]:
            if pt.get("run"):
                print(f"\n### tp {pt['tp']}, {pt['rate_mbit']:g} Mbit/s\n")
                print(rep.format_table(pt["run"]))
        if a.plot or data.get("picture"):
            rep.plot_grid(data, a.plot or data["picture"])
    else:
        print(rep.format_table(data))
        if a.plot:
            rep.plot_run(data, a.plot)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    p.add_argument("--estimate-from", default=None, help="--grid --dry-run: budgets_ms of a run JSON")
    if os.environ.get(ENV_ARGV) is not None:
        run_worker(resolve(p.parse_args(json.loads(os.environ[ENV_ARGV]))))
        return 0
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    if "RANK" in os.environ:  # inside someone's torchrun (lab/cluster/emulate_cluster.py)
        run_worker(resolve(a))
        return 0
    try:
        if a.from_json:
            return _replay(a)
        if a.choose_points:
            a.grid = True  # the grid's participants and rounds
            resolve(a)
            return _choose_points(a)
        resolve(a)
        if a.grid:
            return _grid(p, a)
        our_configs(a)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"bench_peers: error: {e}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.tp * a.pp),
           "-m", "lab.bench.bench_peers"]
    env = env_with_root(WANDB_MODE="disabled", OMP_NUM_THREADS="1", **{ENV_ARGV: json.dumps(argv)})
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=a.timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        print("bench_peers: stopped (timeout or Ctrl-C)", file=sys.stderr)
        return 124


if __name__ == "__main__":
    sys.exit(main())
