#!/usr/bin/env python
"""Replay recorded planner-validation runs under other models of the shared cores' waiting (no runs, no processes).

    python -m lab.validation.replay_contention RUN.json ...   # recorded runs by path (planner_validation_run*.json)
    python -m lab.validation.replay_contention --json out.json RUN.json ...

For every measured configuration of every point, the current planner (from the run's recorded calibration and
emulated device, `validate_planner.recorded_device`) gives S, the simulated step without the shared cores
(its planned step less the waiting for the cores), and C, its planned CPU work over the cores, split by the
calibrated rate it comes from (each rate alone, the others 0). Each model below predicts every configuration
from S and C; per point it is scored by the validation's two targets (Spearman >= 0.8, choice <= 10 % from the
best measured):

* ``own fit``: max(S + c C, C) with the contention c the run planned with (its calibration's or its method's);
* ``linear k``: max(S + k C, C), one k for every point;
* ``load q``: max(S + q C²/S, C), a wait whose rate grows with the load C / S;
* one run left out: k (or q) chosen on the other runs (most points met, then the lower median error), tested
  on the run left out, each run in turn;
* ``measured CPU k``: max(S + k M, M) with M the machine's measured CPU seconds per step over the cores in
  place of C — not a prediction (M is known only after the run), but what the linear form gives with a
  perfect count: it separates a wrong form from a wrong count.

And the machine's measured CPU time per step (less what the idle machine keeps busy) regressed on C's parts: how
far each planned rate is from what the machine spent; and, where the run recorded it, the CPU time its paced
compute actions took (every rank's thread time inside F, B, I and W) over C's compute part. Not an independent
check of anything: the measured configurations were chosen by the rankings of their day, and a model chosen
here must run on the grids.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from lab.cluster.shared_cpu import SHARED_CPU, WAITING, EmulatedCluster
from lab.validation import validate_planner as vp
from lab.validation.validation import (GridPoint, ModelPoint, median_error, read_results,
                                            summarize)

RATES = ("compute_cpu_share", "cpu_s_per_step", "cpu_s_per_action", "cpu_s_per_param", "cpu_s_per_intra_byte",
         "cpu_s_per_nic_byte")
"""The calibrated rates whose terms make up a step's planned CPU work (`lab.cluster.shared_cpu.shared_cpu_s`)."""
LINEAR = (0.0, 0.1, 0.2, 0.225, 0.25, 0.26, 0.275, 0.3, 0.325, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7)
LOAD = (0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)
MEASURED = (0.1, 0.15, 0.2, 0.26, 0.3)


def configurations(path: str) -> list[dict[str, Any]]:
    """Every measured configuration of the run at `path`: its point, S, C (total and per rate), the contention
    the run planned with, measured step and the machine's CPU time per step."""
    data = read_results(path)
    run = Path(path).stem.replace("planner_validation_", "")
    out = []
    for rec in data["points"]:
        if "calibration" not in rec:
            continue
        pj = rec["point"]
        point = GridPoint(ModelPoint(**pj["model"]), pj["hosts"], pj["procs_per_host"], pj["rate_mbit"])
        device = vp.recorded_device(point, rec["calibration"], data.get("method", {}), f"{path} ({rec['key']})")
        shared = device.shared
        if not shared:
            continue
        ok = {r["name"]: r for r in rec["results"] if r.get("status") == "ok"}
        # the simulated step without the cores: the planned step less the waiting the search added to it
        ranked = {c.name: c for c in vp.ranking(point, device) if c.name in ok}
        alone = {n: c.step_s - c.breakdown.get(WAITING, 0.0) for n, c in ranked.items()}
        parts: dict[str, dict[str, float]] = {n: {} for n in ok}
        for rate in RATES:
            one = dataclasses.replace(shared, cpu_contention=0.0,
                                      **{r: (getattr(shared, r) if r == rate else 0.0) for r in RATES})
            for c in vp.ranking(point, EmulatedCluster(device.cluster, one)):
                if c.name in ok:
                    parts[c.name][rate] = c.terms[SHARED_CPU] / shared.cores
        idle = rec["calibration"]["measured"].get("shared_cpu", {}).get("idle_busy_cores", 0.0)
        for name, r in ok.items():
            # the paced compute actions' CPU time per step, every rank (compute_ms: per action, over the timed steps)
            compute = (sum(v["actions"] * v["cpu"] for v in r["compute_ms"].values()) / 1e3 / len(r["rounds_s"])
                       if r.get("compute_ms") and r.get("rounds_s") else None)
            out.append({"run": run, "point": rec["key"], "name": name, "S": alone[name],
                        "C": sum(parts[name].values()), "parts": parts[name], "cores": shared.cores,
                        "contention": shared.cpu_contention, "measured_s": r["measured_s"],
                        "machine_cpu_s": (r["machine_cpu_s"] - idle * r["measured_s"]
                                          if r.get("machine_cpu_s") is not None else None),
                        "compute_cpu_s": compute, "tensor_parallel": ranked[name].tp_bytes > 0})
    return out


def by_point(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    points: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        points.setdefault((r["run"], r["point"]), []).append(r)
    return points


def score(model: Callable[[dict[str, Any]], float],
          points: dict[tuple[str, str], list[dict[str, Any]]]) -> dict[str, Any]:
    """Points meeting both targets under `model` (the validation's `summarize`), the misses, and the median
    |measured / predicted - 1| over every configuration."""
    misses, every = [], []
    for key, rows in points.items():
        again = [{"name": r["name"], "status": "ok", "predicted_s": model(r), "measured_s": r["measured_s"]}
                 for r in rows]
        s = summarize(again)
        if not (s.get("spearman_target_met") and s.get("choice_target_met")):
            misses.append(f"{key[0]} {key[1]}")
        every += again
    return {"met": len(points) - len(misses), "points": len(points), "misses": misses,
            "median_error": round(median_error(every), 3)}


def linear(k: float) -> Callable[[dict[str, Any]], float]:
    return lambda r: max(r["S"] + k * r["C"], r["C"])


def load(q: float) -> Callable[[dict[str, Any]], float]:
    return lambda r: max(r["S"] + q * r["C"] ** 2 / r["S"], r["C"])


def measured_cpu(k: float) -> Callable[[dict[str, Any]], float]:
    """max(S + k M, M), M the machine's measured CPU per step over the cores (not a prediction: module docstring)."""
    def f(r: dict[str, Any]) -> float:
        m = r["machine_cpu_s"] / r["cores"]
        return max(r["S"] + k * m, m)
    return f


def compute_ratios(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The paced compute actions' measured CPU time over C's compute part (median and 10th/90th percentiles), for
    the configurations without tensor parallelism and for those with it (whose collectives run inside the
    actions)."""
    import numpy as np

    out: dict[str, Any] = {}
    for label, want in (("without tp", False), ("with tp", True)):
        x = [r["compute_cpu_s"] / (r["parts"]["compute_cpu_share"] * r["cores"]) for r in rows
             if r.get("compute_cpu_s") is not None and r["parts"].get("compute_cpu_share", 0.0) > 0
             and r["tensor_parallel"] == want]
        if x:
            q10, q50, q90 = np.percentile(x, [10, 50, 90])
            out[label] = {"configurations": len(x), "median": round(float(q50), 2), "p10": round(float(q10), 2),
                          "p90": round(float(q90), 2)}
    return out or None


def leave_one_run_out(points: dict[tuple[str, str], list[dict[str, Any]]], family: Callable[[float], Callable],
                      values: Sequence[float]) -> list[dict[str, Any]]:
    """For each run: the value of `family` (`linear` or `load`) among `values` that does best on the other runs
    (most points met, then the lower median error), and how it does on this one."""
    out: list[dict[str, Any]] = []
    runs = sorted({k[0] for k in points})
    for run in runs if len(runs) > 1 else []:  # one run: nothing to choose on
        train = {k: v for k, v in points.items() if k[0] != run}
        test = {k: v for k, v in points.items() if k[0] == run}

        def rank(x: float) -> tuple[int, float]:
            s = score(family(x), train)
            return s["met"], -s["median_error"]

        x = max(values, key=rank)
        out.append({"run": run, "value": x} | score(family(x), test))
    return out


def regression(rows: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """Least-squares multipliers of C's parts that best give the machine's CPU seconds per step (over the cores)."""
    import numpy as np

    use = [r for r in rows if r["machine_cpu_s"] is not None]
    if len(use) < len(RATES):
        return None
    x = np.array([[r["parts"][k] * r["cores"] for k in RATES] for r in use])
    y = np.array([r["machine_cpu_s"] for r in use])
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    return {k: round(float(c), 2) for k, c in zip(RATES, coef)}


def report(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    points = by_point(rows)
    return {"points": len(points), "configurations": len(rows),
            "own fit": score(lambda r: max(r["S"] + r["contention"] * r["C"], r["C"]), points),
            "linear": {str(k): score(linear(k), points) for k in LINEAR},
            "load": {str(q): score(load(q), points) for q in LOAD},
            "linear, one run left out": leave_one_run_out(points, linear, LINEAR),
            "load, one run left out": leave_one_run_out(points, load, LOAD),
            "measured CPU": ({str(k): score(measured_cpu(k), points) for k in MEASURED}
                             if all(r["machine_cpu_s"] is not None for r in rows) else None),
            "machine CPU / planned, by rate": regression(rows),
            "compute actions' CPU / planned compute": compute_ratios(rows)}


def table(rep: dict[str, Any]) -> str:
    out = [f"{rep['points']} points, {rep['configurations']} measured configurations", "",
           "| model | points meeting both targets | median error | misses |", "|---|---|---|---|"]

    def row(name: str, s: dict[str, Any]) -> None:
        out.append(f"| {name} | {s['met']} of {s['points']} | {100 * s['median_error']:.1f} % | "
                   f"{', '.join(s['misses']) or '—'} |")

    row("own fit: max(S + c C, C)", rep["own fit"])
    for k, s in rep["linear"].items():
        row(f"linear: max(S + {k} C, C)", s)
    for q, s in rep["load"].items():
        row(f"load: max(S + {q} C²/S, C)", s)
    for k, s in (rep.get("measured CPU") or {}).items():
        row(f"measured CPU (not a prediction): max(S + {k} M, M)", s)
    out.append("")
    for family in ("linear", "load"):
        loro = rep[f"{family}, one run left out"]
        if loro:
            out.append(f"{family}, its value chosen on the other runs: " + ", ".join(
                f"{x['run']} {x['value']}: {x['met']}/{x['points']}" for x in loro)
                + f" — {sum(x['met'] for x in loro)} of {sum(x['points'] for x in loro)}")
    if rep["machine CPU / planned, by rate"]:
        out.append("machine CPU per step / planned, per rate (least squares): " + ", ".join(
            f"{k} ×{v}" for k, v in rep["machine CPU / planned, by rate"].items()))
    for label, x in (rep.get("compute actions' CPU / planned compute") or {}).items():
        out.append(f"paced compute actions' CPU / planned compute, {label}: median ×{x['median']} "
                   f"(10th–90th percentile ×{x['p10']}–×{x['p90']}, {x['configurations']} configurations)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="replay_contention.py", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", metavar="RUN_JSON", help="recorded runs (planner_validation_run*.json)")
    p.add_argument("--json", default=None, help="also write the report here")
    a = p.parse_args(argv)
    try:
        rows = [r for path in a.runs for r in configurations(path)]
    except (OSError, ValueError, KeyError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    if not rows:
        p.exit(2, f"{p.prog}: error: no point of {', '.join(a.runs)} has shared cores and measured configurations\n")
    rep = report(rows)
    print(table(rep))
    if a.json:
        Path(a.json).write_text(json.dumps(rep, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
