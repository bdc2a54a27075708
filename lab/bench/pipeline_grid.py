"""The NIC-rate grid of lab/bench/bench_pipeline.py --grid: summaries, the target line, Markdown tables, the picture.

Pure functions of a grid's JSON (one per model): nothing here runs a benchmark, so every table and
picture can be redrawn from ``docs/results/pipeline_grid_MODEL.json`` (``--from-json``).

A grid JSON is ``{"kind": GRID_KIND, "model", "rates_mbit", "baseline", "method", "configs", "target",
"points": [...]}``; a point is ``{"rate_mbit", "label", "overrides", "status", "reason", "rounds_done",
"rounds_planned", "wall_s", "records", "simulated"}`` (``label``/``overrides``: an operating point that also
changes the shape, `grid_points.py`) with ``status`` "complete", "stopped" (failed, timed out or
interrupted: its records hold the rounds that finished) or "not run" (the grid was stopped first). Each
record holds its physical bound (`physical_bound.py`); the second target line is issue 35's: the method at
>= PHYSICAL of its physical bound at every point.
"""
from __future__ import annotations

from typing import Any, Sequence

GRID_KIND = "bench_pipeline grid"
BASELINE = "1f1b+allgather"
METHOD = "eager-1f1b+broadcast+dw"
EXTRA = "1f1b+sendrecv"
# the target of issue 13: where the baseline is below BELOW of its signal bound, the method wins back CLOSURE
BELOW, CLOSURE = 0.90, 0.75
PHYSICAL = 0.90  # issue 35: the method at >= this fraction of its physical bound at every point


def _by(records: Sequence[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    return {r["config"]: r for r in records or []}


def target_row(point: dict[str, Any], baseline: str, method: str, below: float = BELOW,
               closure: float = CLOSURE) -> dict[str, Any]:
    """One rate's verdict: "met", "not met", "n/a" (baseline already at >= `below` of its bound), "void"
    (baseline or method above 100 % of its own signal bound), "stopped" or "not run". Only "met" is met."""
    by = _by(point.get("records"))
    b, m = by.get(baseline), by.get(method)
    row = {"rate_mbit": point["rate_mbit"], "label": _label(point), "baseline_fraction": b and b.get("signal_fraction"),
           "gap_closure": m and m.get("gap_closure"), "method_fraction": m and m.get("signal_fraction")}
    if point["status"] != "complete":
        row["status"] = point["status"]
    elif b is None or m is None or row["baseline_fraction"] is None or m.get("signal_fraction") is None:
        row["status"] = "missing"  # a configuration or its signal run was not part of the grid
    elif b.get("void") or m.get("void"):
        row["status"] = "void"
    elif row["baseline_fraction"] >= below:
        row["status"] = "n/a"
    else:
        g = row["gap_closure"]
        row["status"] = "met" if g is not None and g >= closure else "not met"
    return row


def target_verdict(grid: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The target line for one model and its per-rate rows. The line is "met" only if every rate is
    "met" or "n/a" (a void, stopped or missing rate could have been either, so it never counts)."""
    t = grid.get("target") or {}
    below, closure = t.get("baseline_below", BELOW), t.get("gap_closure_at_least", CLOSURE)
    rows = [target_row(p, grid["baseline"], grid["method"], below, closure) for p in grid["points"]]
    applicable = [r for r in rows if r["status"] != "n/a"]
    met = [r for r in applicable if r["status"] == "met"]
    ok = len(met) == len(applicable)
    others = [f"{r['label']} Mbit/s {r['status']}" for r in applicable if r["status"] != "met"]
    line = (f"target ({grid['model']}): at every rate where {grid['baseline']} is below {below:.0%} of its signal "
            f"bound, {grid['method']} wins back >= {closure:.0%} of the gap: {'MET' if ok else 'NOT MET'} "
            f"(met at {len(met)} of {len(applicable)} such rates"
            + (f"; {', '.join(others)}" if others else "") + "; n/a: "
            + (", ".join(r["label"] for r in rows if r["status"] == "n/a") or "none") + ")")
    return line, rows


def _label(point: dict[str, Any]) -> str:
    return point.get("label") or f"{point['rate_mbit']:g}"


def physical_verdict(grid: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """Issue 35's target: the method at >= PHYSICAL of its physical bound at every point. Per point "met",
    "not met", "void" (faster than its bound), "stopped", "not run" or "missing"; the line is "met" only when
    every point is."""
    need = (grid.get("target") or {}).get("method_physical_at_least", PHYSICAL)
    rows = []
    for p in grid["points"]:
        m = _by(p.get("records")).get(grid["method"])
        row = {"label": _label(p), "fraction": m and m.get("physical_fraction"),
               "binding": m and (m.get("physical") or {}).get("binding")}
        if p["status"] != "complete":
            row["status"] = p["status"]
        elif m is None or row["fraction"] is None:
            row["status"] = "missing"
        elif m.get("physical_void"):
            row["status"] = "void"
        else:
            row["status"] = "met" if row["fraction"] >= need else "not met"
        rows.append(row)
    met = [r for r in rows if r["status"] == "met"]
    line = (f"target ({grid['model']}): {grid['method']} at >= {need:.0%} of its physical bound at every point: "
            f"{'MET' if len(met) == len(rows) else 'NOT MET'} (met at {len(met)} of {len(rows)}"
            + "".join(f"; {r['label']} Mbit/s {r['status']}" for r in rows if r["status"] != "met") + ")")
    return line, rows


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}×"


def _num(r: dict[str, Any] | None, key: str, fmt) -> str:
    if r is None:
        return "-"
    s = fmt(r.get(key))
    return f"**void** ({s})" if r.get("void") and key in ("signal_fraction", "gap_closure") else s


def format_grid(grid: dict[str, Any], format_table=None) -> str:
    """Markdown: the per-rate summary (measured and simulated), the target table, the target line, and
    (with `format_table`, pipeline_output.py's) every point's full table."""
    base, meth = grid["baseline"], grid["method"]
    extra = grid.get("extra") or EXTRA
    head = ["NIC Mbit/s", "run", f"{base} ms", f"{base} of its signal bound", f"{base} of its physical bound",
            f"{extra} vs {base}", f"{meth} ms", "vs baseline", "gap closure", "of its signal bound",
            "of its physical bound (binding)", "gap closure vs physical",
            "simulated: vs baseline / gap closure / of signal / of physical"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in grid["points"]:
        by, sim = _by(p.get("records")), _by(p.get("simulated"))
        b, m, e, sm = by.get(base), by.get(meth), by.get(extra), sim.get(meth)
        run = p["status"] if p["status"] != "stopped" else \
            f"stopped after {p.get('rounds_done', 0)}/{p.get('rounds_planned', '?')} rounds ({p.get('reason')})"
        out.append("| " + " | ".join([
            _label(p), run, _num(b, "ms_per_iter", lambda v: "-" if v is None else f"{v:.0f}"),
            _num(b, "signal_fraction", _pct), _phys(b), _num(e, "speedup_vs_baseline", _x),
            _num(m, "ms_per_iter", lambda v: "-" if v is None else f"{v:.0f}"),
            _num(m, "speedup_vs_baseline", _x), _num(m, "gap_closure", _pct), _num(m, "signal_fraction", _pct),
            _phys(m, binding=True), _num(m, "physical_gap_closure", _pct),
            "-" if sm is None else
            f"{_x(sm['speedup_vs_baseline'])} / {_pct(sm.get('gap_closure'))} / {_pct(sm['signal_fraction'])} / "
            f"{_pct(sm.get('physical_fraction'))}",
        ]) + " |")
    line, rows = target_verdict(grid)
    out += ["", f"| NIC Mbit/s | {base} of its signal bound | {meth} gap closure | target | reason |",
            "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['label']} | {_pct(r['baseline_fraction'])} | {_pct(r['gap_closure'])} | "
                   f"{r['status']} |  |")
    out += ["", line]
    pline, prows = physical_verdict(grid)
    out += ["", f"| NIC Mbit/s | {meth} of its physical bound | binding term | target |", "|---|---|---|---|"]
    out += [f"| {r['label']} | {_pct(r['fraction'])} | {r['binding'] or '-'} | {r['status']} |" for r in prows]
    out += ["", pline]
    if format_table is not None:
        for p in grid["points"]:
            if p.get("records"):
                out += ["", f"#### {grid['model']}, NIC {_label(p)} Mbit/s ({p['status']}, "
                            f"{p.get('rounds_done')} timed rounds)", "", format_table(p["records"])]
    return "\n".join(out)


def _phys(r: dict[str, Any] | None, binding: bool = False) -> str:
    if r is None or r.get("physical_fraction") is None:
        return "-"
    s = f"{r['physical_fraction']:.0%}"
    if binding:
        s += f" ({(r.get('physical') or {}).get('binding', '-')})"
    return f"**void** ({s})" if r.get("physical_void") else s


def plot_grid(grid: dict[str, Any], path: str) -> None:
    """Speedup over the baseline (left) and gap closure with the baseline's fraction of its bound (right)
    against the NIC rate; measured points filled and joined, the simulator's prediction hollow and dashed.
    Void points are red crosses, stopped points are labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base, meth = grid["baseline"], grid["method"]
    extra = grid.get("extra") or EXTRA
    meth_sig = _signal_name(meth)
    # x: the rate (log 2) when every point is a plain rate, else the points in order, labelled
    plain = all(not p.get("overrides") for p in grid["points"]) and \
        len({p["rate_mbit"] for p in grid["points"]}) == len(grid["points"])
    xs = [p["rate_mbit"] if plain else k for k, p in enumerate(grid["points"])]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = [(ax1, meth, "speedup_vs_baseline", "#4c72b0", f"{meth}"),
              (ax1, extra, "speedup_vs_baseline", "#c44e52", f"{extra}"),
              (ax1, meth_sig, "speedup_vs_baseline", "#999999", f"{meth_sig} (its bound)"),
              (ax2, meth, "gap_closure", "#4c72b0", f"{meth}: gap closure"),
              (ax2, base, "signal_fraction", "#dd8452", f"{base}: fraction of its signal bound")]
    for ax, name, key, color, label in series:
        for source, style in (("records", dict(marker="o", linestyle="-")),
                              ("simulated", dict(marker="o", linestyle="--", markerfacecolor="none"))):
            pts = [(xs[k], _by(p.get(source)).get(name), p) for k, p in enumerate(grid["points"])]
            pts = [(x, r, p) for x, r, p in pts if r is not None and r.get(key) is not None]
            good = [(x, r[key]) for x, r, _ in pts if not r.get("void")]
            if good:
                ax.plot(*zip(*good), color=color, label=label + (" (simulated)" if source == "simulated" else ""),
                        **style)
            for x, r, p in pts:
                if r.get("void"):
                    ax.plot([x], [r[key]], marker="x", color="red", markersize=9, linestyle="none")
                    ax.annotate("void", (x, r[key]), textcoords="offset points", xytext=(4, 4), fontsize=7,
                                color="red")
                elif source == "records" and p["status"] != "complete":
                    ax.annotate(p["status"], (x, r[key]), textcoords="offset points", xytext=(4, -10), fontsize=7)
    t = grid.get("target") or {}
    ax1.axhline(1.0, color="black", linewidth=0.6)
    ax2.axhline(t.get("gap_closure_at_least", CLOSURE), color="#4c72b0", linewidth=0.7, linestyle=":",
                label=f"target: gap closure >= {t.get('gap_closure_at_least', CLOSURE):.0%}")
    ax2.axhline(t.get("baseline_below", BELOW), color="#dd8452", linewidth=0.7, linestyle=":",
                label=f"target applies below {t.get('baseline_below', BELOW):.0%}")
    for ax, ylabel in ((ax1, f"speedup over {base}"), (ax2, "share")):
        if plain:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([_label(p) for p in grid["points"]], fontsize=7)
        ax.set_xlabel("NIC rate (Mbit/s, each direction)" + ("" if plain else "; m: microbatches, seq: sequence"))
        ax.set_ylabel(ylabel)
        ax.grid(linestyle=":", linewidth=0.5)
        ax.legend(fontsize=7)
    ax2.set_ylim(min(0.0, ax2.get_ylim()[0]), max(1.1, ax2.get_ylim()[1]))
    fig.suptitle(f"{grid['model']}: paced compute, {grid.get('cluster', '')}; filled = measured, hollow = "
                 "simulated", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _signal_name(config: str) -> str:
    parts = config.split("+")
    return "+".join([parts[0], "signal"] + parts[2:])
