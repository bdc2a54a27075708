#!/usr/bin/env python
"""Pipeline schedules × cross-stage resharding strategies, side by side in one launch (paper §4–§5).

    # the NIC-rate grid (issue 13): both models, paced, every rate on the emulated cluster (root); writes
    # docs/results/pipeline_grid_MODEL.json and docs/img/pipeline_grid_MODEL.png, prints Markdown tables
    python -m lab.bench.bench_pipeline --grid
    python -m lab.bench.bench_pipeline --grid --dry-run          # each point's command and a wall-time estimate only
    python -m lab.bench.bench_pipeline --from-json docs/results/pipeline_grid_gpt.json   # redraw its tables and picture
    # one point by hand: one pipeline stage per host, tp 2 inside each host, slow NICs
    python -m lab.cluster.emulate_cluster --hosts 4 --procs-per-host 2 --nic-rate 100mbit -- \
        -m lab.bench.bench_pipeline --tp 2 --pp 4 --nic-gbps 0.1 --json out.json --plot bars.png \
        --trace-dir traces/ --compare-plot timelines.png
    # plain torchrun on this machine (no rate limit; a smoke run)
    python -m lab.bench.bench_pipeline --nproc 4 --tp 1 --pp 4 --configs 1f1b+allgather,1f1b+broadcast
    # no processes: the simulator with per-action costs (measured: --costs-from a JSON of a real run)
    python -m lab.bench.bench_pipeline --simulate --costs-from out.json --nic-gbps 0.1
    # redraw the table and pictures of a finished run
    python -m lab.bench.bench_pipeline --from-json out.json --trace-dir traces/ --plot bars.png --compare-plot cmp.png
    # the U-Transformer (skip edges across stages): same flags, --u-* for its shape
    python -m lab.cluster.emulate_cluster ... -- -m lab.bench.bench_pipeline --model utransformer --nic-gbps 0.2 ...

A configuration is ``SCHEDULE+STRATEGY[+dw]``: schedule gpipe|1f1b|eager-1f1b, strategy
sendrecv|allgather|broadcast|signal, ``+dw`` = delayed weight gradients. For every
(schedule, dw) pair used, ``SCHEDULE+signal[+dw]`` is added (unless ``--no-signal``): the
same run with 1-byte transfers, the upper bound of what communication can cost.

All configurations share ONE model, optimizer and batch; each has its own
``PipelineRuntime`` (its own resharders). Iterations are interleaved — round r runs one
iteration of every configuration — so slow drift of the machine's load hits all alike.
An iteration is timed between a barrier and the end of the optimizer step, as the max
over ranks; the median over ``--iters`` rounds after ``--warmup`` is reported.

Per configuration: ms/iteration, tokens/s, speedup over the baseline (``--baseline``, default
the Megatron-style ``1f1b+allgather``: send to one rank per receiving host, all-gather inside it),
gap closure = (t_baseline − t) / (t_baseline − t_signal), the share of what communication costs the
baseline that the configuration wins back, fraction of the signal upper bound = t(signal, same schedule) / t
and = min over all signal runs / t — each from medians, from the fastest round (``_min``)
and as the median of per-round ratios (``_paired``) —, the model's seconds per transfer at
``--nic-gbps`` (all edges a stage sends, for the busiest stage), and
the measured per-action times (F/B/I/W medians per stage, from the runtime's trace of
the last round). Rank 0 prints progress and the table, writes ``--json``, ``--plot``,
``--trace-dir`` (one ``CONFIG.json`` per config for ``tools/plot_schedule.py --trace``) and
``--compare-plot`` (measured timelines of ``--compare A,B`` stacked, paper Figure 4). A configuration
above 100 % of its own signal bound is marked void (``"void": true``, **void** in the tables): no
correct measurement can be, and a void number never counts as meeting a target. While running, rank 0
rewrites ``--json`` after every timed round (``"status": "running"``), so a run that is stopped leaves
its finished rounds behind.

``--grid`` runs, for each of ``--models``, one paced launch per operating point (``--points``, default
``grid_points.GRID_POINTS``: a NIC rate, optionally with another microbatch count or sequence length, fixed
before running with ``--choose-points``, which prints the simulator's prediction at every candidate) on
``lab/cluster/emulate_cluster.py`` (4 hosts × 2 ranks), with the baseline, the extra ``1f1b+sendrecv`` row,
the full method ``eager-1f1b+broadcast+dw`` and their signal runs. Every point started is reported: one that
fails, times out (``--point-timeout``) or is interrupted (Ctrl-C) is "stopped", with the rounds it finished.
Beside every measured point, the simulator's prediction at the same per-action budgets and rate. Per model:
the grid's JSON, a picture (speedup over the baseline and gap closure per point, measured and simulated) and
Markdown tables with two target lines (pipeline_grid.py): at every point where the baseline is below 90 % of
its signal bound the full method wins back >= 75 % of the gap; the full method at >= 90 % of its **physical
bound** (``physical_bound.py``: every rank's compute, every NIC side's bytes ÷ its rate, the fill-and-drain
critical path — the largest; a measurement below it is void) at every point.

``--pace auto`` emulates one dedicated device per rank: after the (unpaced) warm-up rounds,
every F/B/I/W of a stage is given a fixed wall time — a quantile of its warm-up durations ×
a margin, the same for every configuration — and an action that finishes early sleeps the
rest. The durations are the signal configurations' where they cover every kind (their 1-byte
transfers leave a compute action's tp collective nothing to wait for; a real transfer at a low
rate makes one tp rank wait inside it for its partner's input, which would count network time as
compute), else every configuration's. Without it, ranks that share a few CPU cores lend a stage's core to the other stages
while it waits for the network, which hides communication under *any* schedule and is
what no GPU stage can do. Compute then costs the same in every configuration and only
communication and scheduling differ; actions that outlast their budget are counted
(``pace_overruns``) and reported. Results of a paced run are labelled as such.

Inside torchrun (``RANK`` set, e.g. under ``lab/cluster/emulate_cluster.py``) this script is the
worker; otherwise it starts ``torchrun --standalone --nproc-per-node N`` on itself and
hands the arguments over in the environment (torchrun's own parser would claim
``--nproc``), or with ``--simulate`` runs no processes at all.

This file is the entry point (``main``: the launcher, ``--simulate``, ``--from-json`` and the grid's loop); the
rest lives beside it, each part importable from here as before: the configurations and flags
(``pipeline_args.py``), the records and the simulator's records (``pipeline_records.py``), the worker inside
torchrun (``pipeline_worker.py``), the table, JSON, traces and pictures (``pipeline_output.py``) and the grid's
points as launches (``pipeline_grid_run.py``; the grid's tables and picture: ``pipeline_grid.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from lab import env_with_root
from lab.bench import pipeline_grid  # the grid's tables and picture
# the parts of this tool (see the docstring); every name other code reads from bench_pipeline is re-exported
from lab.bench.pipeline_args import (DEFAULT_CONFIGS, GRID_CONFIGS, GRID_DEFAULTS, GRID_RATES, MODELS, RUN_DEFAULTS,
                                     SCHEDULE_NAMES, STRATEGY_NAMES, WORKER_DESTS, BenchConfig, build_parser,
                                     check_args, expand_configs, graph_and_shapes, model_argv, parse_config,
                                     parse_model_config, parse_rates, resolve_defaults)
from lab.bench.pipeline_grid_run import (GRID_SETUP_S, _at, _choose_points, _grid_dry_run, _run_point,
                                         estimate_point_s, grid_points_of, grid_shape, point_command,
                                         point_from_run, worker_argv)
from lab.bench.pipeline_output import finish, format_table, plot_bars, plot_compare, write_json, write_traces
from lab.bench.pipeline_records import (_costs, costs_from_records, edge_transfer_model, fill_physical, fill_ratios,
                                        gap_closure, load_cost_records, make_records, simulate_records)
from lab.bench.pipeline_worker import _worker

__all__ = [
    "SCHEDULE_NAMES", "STRATEGY_NAMES", "MODELS", "DEFAULT_CONFIGS", "GRID_CONFIGS", "GRID_RATES", "GRID_DEFAULTS",
    "RUN_DEFAULTS", "WORKER_DESTS", "ENV_ARGV", "BenchConfig", "parse_config", "expand_configs", "build_parser",
    "resolve_defaults", "parse_rates", "check_args", "model_argv", "parse_model_config", "graph_and_shapes",
    "edge_transfer_model", "make_records", "fill_physical", "fill_ratios", "gap_closure", "costs_from_records",
    "load_cost_records", "simulate_records", "grid_shape", "worker_argv", "point_from_run", "point_command",
    "estimate_point_s", "GRID_SETUP_S", "grid_points_of", "format_table", "write_traces", "finish", "write_json",
    "plot_bars", "plot_compare", "main", "mark_stopped",
]

ENV_ARGV = "MR_BENCH_PIPELINE_ARGV"


# ---- simulate, redraw ----------------------------------------------------------------------------
def _simulate(a: argparse.Namespace) -> int:
    configs = check_args(a)
    world = a.tp * a.pp
    pph = a.procs_per_host or (world // (a.hosts or a.pp))
    costs = _costs(a, configs)
    print(f"[bench_pipeline] simulate: pp {a.pp}, tp {a.tp}, {a.microbatches} microbatches, {pph} ranks/host, "
          f"NIC {a.nic_gbps} Gbit/s; ms per action F {costs['f']} B {costs['b']} I {costs['i']} W {costs['w']}",
          file=sys.stderr)
    records, traces = simulate_records(a, configs, costs, world, pph)
    finish(a, records, traces, configs)
    return 0


def _replay(a: argparse.Namespace) -> int:
    records = json.load(open(a.from_json))
    if isinstance(records, dict) and records.get("kind") == pipeline_grid.GRID_KIND:
        print(pipeline_grid.format_grid(records, format_table), flush=True)
        picture = a.plot or records.get("picture")
        if picture:
            pipeline_grid.plot_grid(records, picture)
            print(f"[bench_pipeline] picture: {picture}", file=sys.stderr)
        return 0
    configs = [parse_config(r["config"]) for r in records]
    traces = []
    for c in configs:
        f = Path(a.trace_dir or "", f"{c.name}.json")
        traces.append(json.loads(f.read_text()) if a.trace_dir and f.exists() else None)
    a.trace_dir = None  # read, not written
    a.json = None if a.json == a.from_json else a.json
    finish(a, records, traces, configs)
    return 0


# ---- the grid's loop: every model at every operating point on the emulated cluster -----------------
# (_grid reads point_command from this module's namespace, where lab/tests/test_bench_pipeline.py replaces it)
def _grid(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    import tempfile

    from lab.cluster.emulate_cluster import check_privileges

    models = [m.strip() for m in a.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        raise ValueError(f"--models {a.models!r}: each of {', '.join(MODELS)}")
    hosts, pph = grid_shape(a)
    configs = check_args(a, hosts * pph)
    names = [c.name for c in configs]
    method = parse_config(a.method).name
    if method not in names:
        raise ValueError(f"--method {method} is not among the configurations ({', '.join(names)})")
    points = {m: grid_points_of(a, m) for m in models}  # every point checked before anything runs
    if a.dry_run:
        return _grid_dry_run(p, a, models, configs)
    check_privileges()  # ClusterError: one line, before anything runs
    os.makedirs(a.results_dir, exist_ok=True)
    os.makedirs(a.img_dir, exist_ok=True)
    cluster = f"{hosts} hosts × {pph} ranks, tp {a.tp}, pp {a.pp}, {a.microbatches} microbatches, --pace {a.pace}"
    grids = {m: {"kind": pipeline_grid.GRID_KIND, "model": m, "rates_mbit": [pt["rate_mbit"] for pt in points[m]],
                 "baseline": a.baseline,
                 "method": method, "extra": pipeline_grid.EXTRA if pipeline_grid.EXTRA in names else None,
                 "configs": names, "cluster": cluster,
                 "target": {"baseline_below": pipeline_grid.BELOW, "gap_closure_at_least": pipeline_grid.CLOSURE,
                            "method_physical_at_least": pipeline_grid.PHYSICAL},
                 "command": " ".join(["python -m lab.bench.bench_pipeline"] + sys.argv[1:]),
                 "picture": os.path.join(a.img_dir, f"pipeline_grid_{m}.png"),
                 "points": [{"rate_mbit": pt["rate_mbit"], "label": pt["label"], "overrides": pt["overrides"],
                             "status": "not run", "reason": None, "records": [], "simulated": None}
                            for pt in points[m]]} for m in models}
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-grid-") as tmp:
        for m in models:
            if interrupted:  # the models not started keep no file: nothing of them ran
                break
            grid, path = grids[m], os.path.join(a.results_dir, f"pipeline_grid_{m}.json")
            for k, pt in enumerate(points[m]):
                if interrupted:
                    break
                pa = _at(a, m, pt)
                out = os.path.join(tmp, f"{m}-{k}.json")
                cmd = point_command(p, pa, m, pt["rate_mbit"], out)
                print(f"[bench_pipeline] grid {m} {pt['label']} Mbit/s: {' '.join(cmd)}", file=sys.stderr, flush=True)
                t0 = time.monotonic()
                try:
                    rc, reason = _run_point(cmd, a.point_timeout)
                except KeyboardInterrupt:
                    rc, reason, interrupted = None, "interrupted (Ctrl-C)", True
                recs = json.load(open(out)) if os.path.exists(out) else None
                point = point_from_run(pt["rate_mbit"], rc, recs, reason, time.monotonic() - t0, a.iters)
                point.update(label=pt["label"], overrides=pt["overrides"])
                if point["records"]:  # the simulator's prediction at the same budgets and rate
                    try:
                        costs = costs_from_records(point["records"], a.pp)
                    except ValueError as e:  # unpaced and stopped before its traces: nothing to feed it
                        print(f"[bench_pipeline] grid {m} {pt['label']} Mbit/s: no prediction: {e}", file=sys.stderr)
                    else:
                        point["simulated"] = simulate_records(pa, configs, costs, hosts * pph, pph)[0]
                grid["points"][k] = point
                write_json(path, grid)  # after every point: a stopped grid keeps what it ran
            print(pipeline_grid.format_grid(grid, format_table), flush=True)
            pipeline_grid.plot_grid(grid, grid["picture"])
            print(f"[bench_pipeline] grid {m}: {path}, {grid['picture']}", file=sys.stderr)
    return 130 if interrupted else 0


# ---- entry ------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    if os.environ.get(ENV_ARGV) is not None:  # started by main() below: arguments come via the environment
        return _worker(p.parse_args(json.loads(os.environ[ENV_ARGV])))
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    if "RANK" in os.environ and not a.simulate:  # inside someone's torchrun (e.g. emulate_cluster.py)
        return _worker(a)
    try:
        if a.choose_points:
            a.grid = True  # the grid's configurations and rounds
            return _choose_points(a)
        if a.grid:
            return _grid(p, a)
        check_args(a, None if a.simulate else a.nproc)
    except (ValueError, NotImplementedError, OSError) as e:  # emulate_cluster's ClusterError is a RuntimeError
        print(f"bench_pipeline: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"bench_pipeline: {e}", file=sys.stderr)
        return 2
    if a.simulate:
        return _simulate(a)
    if a.from_json:
        return _replay(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc),
           "-m", "lab.bench.bench_pipeline"]
    env = env_with_root(WANDB_MODE="disabled", OMP_NUM_THREADS="1", **{ENV_ARGV: json.dumps(argv)})
    print(f"[bench_pipeline] torchrun --standalone, {a.nproc} ranks", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=a.timeout)
        if rc:
            mark_stopped(a.json, f"exit code {rc}")
        return rc
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
        import signal

        os.killpg(proc.pid, signal.SIGTERM)  # torchrun and its workers: our own session only
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        why = f"timed out after {a.timeout:.0f}s" if isinstance(e, subprocess.TimeoutExpired) else "interrupted"
        print(f"[bench_pipeline] stopped: {why}", file=sys.stderr)
        mark_stopped(a.json, why)
        return 124


def mark_stopped(path: str | None, reason: str) -> None:
    """A stopped launch's --json (the rounds it finished) is marked "stopped", with the reason."""
    if not path or not os.path.exists(path):
        if path:
            print(f"[bench_pipeline] stopped before its first timed round: no {path}", file=sys.stderr)
        return
    records = json.load(open(path))
    for r in records:
        if r.get("status") != "complete":
            r.update(status="stopped", stop_reason=reason)
    write_json(path, records)
    print(f"[bench_pipeline] {path}: {records[0].get('rounds_done') if records else 0} finished timed rounds, "
          f"marked stopped", file=sys.stderr)

if __name__ == "__main__":
    sys.exit(main())
