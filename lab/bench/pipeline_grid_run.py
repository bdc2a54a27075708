"""The points of lab/bench/bench_pipeline.py --grid as launches: commands, runs, results, estimates.

Each operating point (``grid_points_of``: --rates, --points or grid_points.GRID_POINTS) is one paced launch of
the worker on the emulated cluster (``point_command``: ``worker_argv`` forwards the flags of ``WORKER_DESTS``),
run by ``_run_point`` (timeout, Ctrl-C) and recorded by ``point_from_run`` (complete, or stopped with the rounds
it finished). ``estimate_point_s`` is a point's wall time from simulated iterations; ``_grid_dry_run``
(--grid --dry-run) and ``_choose_points`` (--choose-points) run nothing but the simulator. The grid's loop
itself is bench_pipeline.py's ``_grid``; its tables and picture are lab/bench/pipeline_grid.py.
"""
from __future__ import annotations

import argparse
import copy
import os
import subprocess
from typing import Any, Sequence

from lab import env_with_root, module_command
from lab.bench.pipeline_args import WORKER_DESTS, BenchConfig, check_args, parse_config, parse_rates
from lab.bench.pipeline_records import _costs, costs_from_records, load_cost_records, simulate_records


def grid_shape(a: argparse.Namespace) -> tuple[int, int]:
    """(hosts, ranks per host) of the grid's emulated cluster: one stage per host, tp ranks in each."""
    return a.hosts or a.pp, a.procs_per_host or a.tp


def worker_argv(p: argparse.ArgumentParser, a: argparse.Namespace, model: str, rate: float, json_path: str) -> list[str]:
    """The bench_pipeline.py arguments of one grid point (forwarded flags, then the point's own)."""
    out: list[str] = []
    for act in p._actions:
        v = getattr(a, act.dest, None)
        if act.dest not in WORKER_DESTS or v is None or v is False:
            continue
        out += [act.option_strings[-1]] if v is True else [act.option_strings[-1], str(v)]
    return out + ["--model", model, "--nic-gbps", f"{rate / 1e3:g}", "--procs-per-host", str(grid_shape(a)[1]),
                  "--json", json_path]


def point_from_run(rate: float, rc: int | None, records: list[dict[str, Any]] | None, reason: str | None,
                   wall_s: float, rounds_planned: int) -> dict[str, Any]:
    """One grid point from its run's exit and JSON: "complete" only if it exited 0 with its final records;
    otherwise "stopped", keeping whatever timed rounds it finished (never dropped)."""
    done = records[0].get("rounds_done", 0) if records else 0
    complete = rc == 0 and bool(records) and records[0].get("status") == "complete"
    if not complete:
        reason = reason or (f"exit code {rc}" if rc else "ended without its final records")
        for r in records or []:
            r["status"] = "stopped"
    return {"rate_mbit": rate, "status": "complete" if complete else "stopped", "reason": None if complete else reason,
            "rc": rc, "wall_s": round(wall_s, 1), "rounds_done": done, "rounds_planned": rounds_planned,
            "records": records or [], "simulated": None}


def _run_point(cmd: list[str], timeout_s: float) -> tuple[int | None, str | None]:
    """Run one point's emulated cluster; (exit code, reason it stopped or None). Ctrl-C reaches the cluster
    too (same process group), which tears itself down; it is waited for, then KeyboardInterrupt goes on."""
    proc = subprocess.Popen(cmd, env=env_with_root())
    try:
        rc = proc.wait(timeout=timeout_s + 120)  # the cluster's own --timeout fires first
    except subprocess.TimeoutExpired:
        proc.terminate()
        return proc.wait(), f"no exit {timeout_s + 120:.0f} s after start"
    except KeyboardInterrupt:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait()
        raise
    return rc, (f"timed out after {timeout_s:.0f} s" if rc == 124 else None)


def point_command(p: argparse.ArgumentParser, a: argparse.Namespace, model: str, rate: float, out: str) -> list[str]:
    """One grid point: the emulated cluster at `rate` running this tool's worker for `model`."""
    hosts, pph = grid_shape(a)
    return module_command("lab.cluster.emulate_cluster", [
        "--hosts", str(hosts), "--procs-per-host", str(pph), "--nic-rate", f"{round(rate * 1e3)}kbit", "--timeout",
        f"{a.point_timeout:g}", "--", "-m", "lab.bench.bench_pipeline", *worker_argv(p, a, model, rate, out)])


def estimate_point_s(records: Sequence[dict[str, Any]], a: argparse.Namespace, setup_s: float) -> float:
    """Wall seconds of one point from simulated iteration times: every round runs every configuration once
    (warm-up, one paced warm-up with --pace auto, timed rounds), plus `setup_s` (start, model, resharders)."""
    rounds = a.warmup + (1 if a.pace == "auto" else 0) + a.iters
    return setup_s + rounds * sum(r["ms_per_iter"] for r in records) / 1e3


GRID_SETUP_S = 30.0  # start-up of one point (torchrun on 4 namespaces, model, every configuration's resharders)


def grid_points_of(a: argparse.Namespace, model: str) -> list[dict[str, Any]]:
    """The grid's operating points for `model`: --rates (at the flags' shape), else --points, else GRID_POINTS."""
    from lab.bench.grid_points import GRID_POINTS, parse_points

    if a.rates:
        return [{"rate_mbit": r, "overrides": {}, "label": f"{r:g}", "text": f"{r:g}"} for r in parse_rates(a.rates)]
    return parse_points(a.points or GRID_POINTS[model])


def _grid_costs(a: argparse.Namespace, model: str, configs: list[BenchConfig]) -> dict[str, Any]:
    """Per-action costs for the grid's estimates: --estimate-costs, else the committed grid's (the highest-rate
    complete point's budgets, grid_points.reference_costs), else --cost-f/b/i/w or F=10, B=2F."""
    from lab.bench.grid_points import reference_costs

    files = dict(x.split("=", 1) for x in (a.estimate_costs or "").split(",") if x.strip())
    if model in files:
        return costs_from_records(load_cost_records(files[model]), a.pp, files[model])
    committed = os.path.join(a.results_dir, f"pipeline_grid_{model}.json")
    if os.path.exists(committed) and a.cost_f is None:
        try:
            return reference_costs(committed, a.pp)[0]
        except ValueError:
            pass
    pa = copy.copy(a)
    pa.model = model
    return _costs(pa, configs)


def _grid_dry_run(p: argparse.ArgumentParser, a: argparse.Namespace, models: list[str],
                  configs: list[BenchConfig]) -> int:
    hosts, pph = grid_shape(a)
    total = 0.0
    for m in models:
        costs, per_model = _grid_costs(a, m, configs), 0.0
        for pt in grid_points_of(a, m):
            pa = _at(a, m, pt)
            est = estimate_point_s(simulate_records(pa, configs, _shape_costs(a, pt, costs), hosts * pph, pph)[0], pa,
                                   GRID_SETUP_S)
            per_model += est
            print(f"# {m} {pt['label']} Mbit/s: about {est / 60:.1f} min (simulated, plus {GRID_SETUP_S:.0f} s set-up)")
            print(" ".join(point_command(p, pa, m, pt["rate_mbit"],
                                         os.path.join(a.results_dir, f"{m}-{pt['text']}.part.json"))))
        print(f"# {m}: about {per_model / 60:.0f} min")
        total += per_model
    print(f"# whole grid: about {total / 60:.0f} min")
    return 0


def _at(a: argparse.Namespace, model: str, point: dict[str, Any]) -> argparse.Namespace:
    from lab.bench.grid_points import apply_point

    pa = apply_point(a, point)
    pa.model = model
    return pa


def _shape_costs(a: argparse.Namespace, point: dict[str, Any], costs: dict[str, Any]) -> dict[str, Any]:
    """Costs at a point that changes the sequence length: scaled by the tokens per microbatch (grid_points)."""
    from lab.bench.grid_points import scale_costs

    seq = point["overrides"].get("seq_length")
    return scale_costs(costs, seq / a.seq_length) if seq else costs


def _choose_points(a: argparse.Namespace) -> int:
    """--choose-points: the simulator's prediction at every candidate, per model (grid_points.choose)."""
    from lab.bench.grid_points import CANDIDATES, GRID_POINTS, choose, parse_points, reference_costs

    models = [m.strip() for m in a.models.split(",") if m.strip()]
    hosts, pph = grid_shape(a)
    configs = check_args(a, hosts * pph)
    for m in models:
        path = os.path.join(a.results_dir, f"pipeline_grid_{m}.json")
        if a.estimate_costs or a.cost_f is not None:
            costs, where = _grid_costs(a, m, configs), a.estimate_costs or "--cost-*"
        else:
            costs, where = reference_costs(path, a.pp)

        def predict(pt, m=m, costs=costs):
            pa = _at(a, m, pt)
            recs = simulate_records(pa, configs, _shape_costs(a, pt, costs), hosts * pph, pph)[0]
            by = {r["config"]: r for r in recs}
            return by[a.baseline], by[parse_config(a.method).name], estimate_point_s(recs, pa, GRID_SETUP_S)

        chosen = [pt["text"] for pt in parse_points(GRID_POINTS[m])]
        print(choose(parse_points(a.points or CANDIDATES), predict, chosen,
                     f"{m}: {hosts} hosts × {pph}, tp {a.tp}, pp {a.pp}, costs of {where}"), flush=True)
        print()
    return 0
