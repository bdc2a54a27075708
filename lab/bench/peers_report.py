"""Pure half of lab/bench/bench_peers.py: ratios, bubble fraction, the void rule, tables, pictures, JSON.

A run's JSON is ``{"kind": RUN_KIND, "status", "setup": {...}, "budgets_ms", "reference_loss",
"loss_tolerance", "records": [...]}``; a record is one participant (megareshard configuration or torch
schedule) with ``framework``, ``name``, ``status`` ("ok" or "failed" with ``reason``), ``ms_all`` (timed
rounds), ``bubble`` and ``act_peak_bytes`` per stage, ``loss``, ``predicted_ms``. A grid JSON is
``{"kind": GRID_KIND, "rates_mbit", "tps", "points": [{"rate_mbit", "tp", "status", "reason", "run"}]}``.
Nothing here runs a benchmark, so ``--from-json`` redraws every table and picture.
"""
from __future__ import annotations

import json
import os
import statistics
from typing import Any, Sequence

RUN_KIND = "bench_peers run"
GRID_KIND = "bench_peers grid"
BASELINE = "1f1b+allgather"
TARGET = 1.2  # issues 14, 35: megareshard's best >= 1.2x torch's best where communication matters
COMM_MATTERS_BELOW = 0.90  # ... i.e. where the baseline is below this fraction of its own physical bound


def bubble_fraction(trace: Sequence[dict[str, Any]], span_s: float) -> float | None:
    """Measured idle / total of one rank: 1 - (time inside compute actions) / (its iteration span)."""
    if span_s <= 0:
        return None
    busy = sum(r["end"] - r["start"] for r in trace if r["kind"] in ("F", "B", "I", "W"))
    return max(0.0, 1.0 - busy / span_s)


def compute_bound_ms(budgets_ms: Sequence[dict[str, float]] | None, microbatches: int) -> float | None:
    """The least time any paced participant can take: per rank, every microbatch's F and backward (B, or
    I + W: the calibration makes B = I + W) at its budget, once per rank whatever the schedule; the max
    over ranks. A measured time below it means some compute escaped pacing."""
    if not budgets_ms:
        return None
    return max(microbatches * (b["F"] + b["B"]) for b in budgets_ms)


def summarise(times_ms: Sequence[float]) -> dict[str, float]:
    med = statistics.median(times_ms)
    q = statistics.quantiles(times_ms, n=4) if len(times_ms) >= 2 else [med, med, med]
    return {"ms_per_iter": med, "ms_q1": q[0], "ms_q3": q[2], "ms_min": min(times_ms)}


def fill_ratios(records: list[dict[str, Any]], bound_ms: float | None, baseline: str = BASELINE) -> dict[str, Any]:
    """Per record: ``void`` (below the compute bound, or megareshard above its own signal run),
    ``vs_torch_best`` (torch's best ms / ms: throughput ratio) and ``vs_baseline``; returns the summary
    (torch's best, megareshard's best, their ratio). Void and failed records never count as best."""
    by = {r["name"]: r for r in records}
    for r in records:
        if r["status"] != "ok":
            r.update(void=False, vs_torch_best=None, vs_baseline=None, signal_fraction=None)
            continue
        sig = by.get(r.get("signal_name") or "")
        r["signal_fraction"] = (sig["ms_per_iter"] / r["ms_per_iter"]
                                if sig and sig["status"] == "ok" and r["strategy"] != "signal" else None)
        below = bound_ms is not None and r["ms_per_iter"] < bound_ms
        pb = (r.get("physical") or {}).get("bound_ms")
        r["physical_fraction"] = pb / r["ms_per_iter"] if pb and r["strategy"] != "signal" else None
        r["physical_void"] = bool(pb and r["strategy"] != "signal" and r["ms_per_iter"] < pb)
        r["void"] = bool(below or r["physical_void"] or (r["signal_fraction"] is not None and r["signal_fraction"] > 1.0))
    ok = [r for r in records if r["status"] == "ok" and not r["void"]]
    torch_best = min((r for r in ok if r["framework"] == "torch"), key=lambda r: r["ms_per_iter"], default=None)
    ours_best = min((r for r in ok if r["framework"] == "megareshard" and r["strategy"] != "signal"),
                    key=lambda r: r["ms_per_iter"], default=None)
    base = by.get(baseline)
    for r in records:
        if r["status"] == "ok":
            r["vs_torch_best"] = torch_best["ms_per_iter"] / r["ms_per_iter"] if torch_best else None
            r["vs_baseline"] = base["ms_per_iter"] / r["ms_per_iter"] if base and base["status"] == "ok" else None
    ratio = torch_best["ms_per_iter"] / ours_best["ms_per_iter"] if torch_best and ours_best else None
    # the best megareshard could physically do: the least physical bound among its configurations
    bounds = [(r["physical"]["bound_ms"], r["name"]) for r in records if r["status"] == "ok" and r.get("physical")
              and r["framework"] == "megareshard" and r["strategy"] != "signal"]
    least = min(bounds, default=None)
    return {"torch_best": torch_best and torch_best["name"], "megareshard_best": ours_best and ours_best["name"],
            "best_ratio": ratio, "baseline_signal_fraction": base and base.get("signal_fraction"),
            "baseline_physical_fraction": base and base.get("physical_fraction"),
            "physical_best_ms": least and least[0], "physical_best_config": least and least[1],
            "physical_best_ratio": torch_best["ms_per_iter"] / least[0] if torch_best and least else None}


def verdict(summary: dict[str, Any]) -> str:
    """The issue's target for one run: >= TARGET x where communication matters (the baseline below
    COMM_MATTERS_BELOW of its physical bound; of its signal bound for a run recorded without one), >= 1.0 x
    elsewhere; "unknown" without the numbers. Where even megareshard's physical bound is not TARGET x
    faster than torch's best (``physical_best_ratio``), the target is physically out of reach, and says so."""
    ratio = summary.get("best_ratio")
    frac = summary.get("baseline_physical_fraction")
    if frac is None:
        frac = summary.get("baseline_signal_fraction")
    if ratio is None or frac is None:
        return "unknown"
    need = TARGET if frac < COMM_MATTERS_BELOW else 1.0
    out = f"{'met' if ratio >= need else 'not met'} (need >= {need:.1f}x)"
    reach = summary.get("physical_best_ratio")
    if reach is not None and reach < need:
        out += (f"; physically out of reach: megareshard's physical bound ({summary['physical_best_ms']:.0f} ms, "
                f"{summary['physical_best_config']}) is only {reach:.2f}x faster than torch's best")
    return out


def sim_peak(r: dict[str, Any]) -> str:
    """The simulator's live activations per stage at the peak, in microbatches of a whole stage (a
    chunk of a V-chunk schedule holds 1/V of a rank's layers)."""
    peak, v = r.get("predicted_peak_activations"), r.get("chunks_per_rank") or 1
    return "-" if not peak else "/".join(f"{x / v:g}" for x in peak)


def format_table(run: dict[str, Any]) -> str:
    """Markdown: one row per participant."""
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    s = run["setup"]
    lines = [f"*{s['cluster']}; {s['microbatches']} microbatches of {s['micro_batch_size']}x{s['seq_length']}, "
             f"{s['num_layers']} layers, hidden {s['hidden_size']}; NIC {s['nic_gbps'] * 1e3:g} Mbit/s; "
             f"{run['status']}*", ""]
    head = ["participant", "ms/iter (median)", "q1-q3", "vs torch best", "vs baseline", "of signal",
            "physical bound ms (binding)", "of physical", "bubble per stage", "peak act. MiB per stage",
            "sim. peak live per stage", "predicted ms", "pace overruns", "loss - ref", "note"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in run["records"]:
        if r["status"] != "ok":
            lines.append("| " + " | ".join([r["name"]] + ["-"] * (len(head) - 2) + [f"{r['status']}: {r['reason']}"])
                         + " |")
            continue
        bub = "/".join(f(b, ".0%") for b in r.get("bubble") or [])
        mem = "/".join(f(None if b is None else b / 2 ** 20, ".1f") for b in r.get("act_peak_bytes") or [])
        note = "**void**" if r.get("void") else ""
        if r.get("loss_ok") is False:
            note += " loss differs"
        pb = r.get("physical")
        lines.append("| " + " | ".join([
            r["name"], f(r["ms_per_iter"], ".0f"), f"{r['ms_q1']:.0f}-{r['ms_q3']:.0f}", f(r.get("vs_torch_best"), ".2f"),
            f(r.get("vs_baseline"), ".2f"), f(r.get("signal_fraction"), ".0%"),
            "-" if not pb else f"{pb['bound_ms']:.0f} ({pb['binding']})", f(r.get("physical_fraction"), ".0%"),
            bub or "-", mem or "-",
            sim_peak(r), f(r.get("predicted_ms"), ".0f"), f(r.get("pace_overruns"), "d"),
            f(r.get("loss_diff"), ".1e"), note.strip()]) + " |")
    sm = run.get("summary") or {}
    lines.append("")
    lines.append(f"megareshard best {sm.get('megareshard_best')} vs torch best {sm.get('torch_best')}: "
                 f"{f(sm.get('best_ratio'), '.2f')}x; target {verdict(sm)}")
    return "\n".join(lines)


def format_grid(grid: dict[str, Any]) -> str:
    """Markdown: one row per (rate, tp) point with the best of each side and the verdict."""
    head = ["NIC Mbit/s", "tp", "status", "torch best (ms)", "megareshard best (ms)", "ratio",
            "baseline of signal", "baseline of physical", "best physically possible ratio", "target"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in grid["points"]:
        run = p.get("run") or {}
        sm = run.get("summary") or {}
        by = {r["name"]: r for r in run.get("records") or []}

        def ms(name):
            return f"{name} ({by[name]['ms_per_iter']:.0f})" if name in by else "-"

        ratio, frac = sm.get("best_ratio"), sm.get("baseline_signal_fraction")
        pfrac, reach = sm.get("baseline_physical_fraction"), sm.get("physical_best_ratio")
        lines.append("| " + " | ".join([p.get("label") or f"{p['rate_mbit']:g}", str(p["tp"]), p["status"],
                                         ms(sm.get("torch_best")), ms(sm.get("megareshard_best")),
                                         "-" if ratio is None else f"{ratio:.2f}x",
                                         "-" if frac is None else f"{frac:.0%}",
                                         "-" if pfrac is None else f"{pfrac:.0%}",
                                         "-" if reach is None else f"{reach:.2f}x",
                                         verdict(sm) if p["status"] == "complete" else "-"]) + " |")
    return "\n".join(lines)


def write_json(path: str, data: Any) -> None:
    tmp = f"{path}.part"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
    os.replace(tmp, path)


def load_json(path: str) -> dict[str, Any]:
    data = json.load(open(path))
    if not isinstance(data, dict) or data.get("kind") not in (RUN_KIND, GRID_KIND):
        raise ValueError(f"{path} is neither a bench_peers run nor a bench_peers grid JSON")
    return data


def plot_run(run: dict[str, Any], path: str) -> None:
    """Bars (ms/iteration, median with q1-q3; the simulator's prediction as a tick) and per-stage peak
    activation memory, one group of bars per participant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in run["records"] if r["status"] == "ok"]
    if not recs:
        raise ValueError("no participant finished: nothing to draw")
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(2.0 + 0.75 * len(recs), 7.5))
    x = range(len(recs))
    ms = [r["ms_per_iter"] for r in recs]
    err = [[m - r["ms_q1"] for m, r in zip(ms, recs)], [r["ms_q3"] - m for m, r in zip(ms, recs)]]
    colors = ["#c44e52" if r["framework"] == "torch" else "#bbbbbb" if r["strategy"] == "signal" else "#4c72b0"
              for r in recs]
    bars = ax.bar(x, ms, yerr=err, capsize=3, color=colors, edgecolor="black", linewidth=0.6)
    for bar, r in zip(bars, recs):
        if r.get("void"):
            bar.set_hatch("xx")
        if r.get("predicted_ms"):
            ax.plot([bar.get_x(), bar.get_x() + bar.get_width()], [r["predicted_ms"]] * 2, color="black", lw=2)
        if r.get("vs_torch_best"):
            ax.text(bar.get_x() + bar.get_width() / 2, r["ms_q3"] * 1.01, f"{r['vs_torch_best']:.2f}x",
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x))
    ax.set_xticklabels([r["name"] for r in recs], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("ms per iteration (median, q1-q3)\nblack line: simulated")
    s = run["setup"]
    ax.set_title(f"megareshard (blue; grey: signal bound; hatched: void) vs torch.distributed.pipelining (red)\n"
                 f"{s['cluster']}, NIC {s['nic_gbps'] * 1e3:g} Mbit/s; labels: throughput vs torch's best", fontsize=8)
    pp = s["pp"]
    w = 0.8 / pp
    for st in range(pp):
        vals = [((r.get("act_peak_bytes") or [None] * pp)[st] or 0) / 2 ** 20 for r in recs]
        ax2.bar([i - 0.4 + w * (st + 0.5) for i in x], vals, w, label=f"stage {st}")
    ax2.set_xticks(list(x))
    ax2.set_xticklabels([r["name"] for r in recs], rotation=35, ha="right", fontsize=7)
    ax2.set_ylabel("peak saved activations, MiB")
    ax2.legend(fontsize=7, ncol=pp)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_grid(grid: dict[str, Any], path: str) -> None:
    """Three panels: megareshard's best / torch's best against the NIC rate (one line per tp); every
    participant's throughput relative to torch's best at each rate (bars, the tp with most points);
    the measured peak activation memory per stage of every participant (its first complete point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [p for p in grid["points"] if p["status"] == "complete" and p.get("run")]
    names: list[str] = []
    for p in done:
        names += [r["name"] for r in p["run"]["records"] if r["status"] == "ok" and r["name"] not in names]
    fig, (ax, ax2, ax3) = plt.subplots(3, 1, figsize=(max(7.0, 1.5 + 0.6 * len(names)), 11))
    for tp in grid["tps"]:
        pts = [(p["rate_mbit"], p["run"]["summary"].get("best_ratio")) for p in done if p["tp"] == tp]
        pts = [(r, v) for r, v in pts if v is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"tp {tp}")
    ax.axhline(TARGET, color="grey", ls="--", lw=1, label=f"target {TARGET}x where communication matters")
    ax.axhline(1.0, color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xticks(grid["rates_mbit"])
    ax.set_xticklabels([f"{r:g}" for r in grid["rates_mbit"]])
    ax.minorticks_off()
    ax.set_xlabel("NIC rate, Mbit/s")
    ax.set_ylabel("megareshard best / torch best")
    ax.set_title(f"megareshard vs torch.distributed.pipelining, pp {grid['pp']} (throughput ratios)", fontsize=9)
    ax.legend(fontsize=7)
    if done:
        tp = max(grid["tps"], key=lambda t: sum(p["tp"] == t for p in done))
        pts = [p for p in done if p["tp"] == tp]
        w = 0.8 / len(pts)
        for k, p in enumerate(pts):
            by = {r["name"]: r for r in p["run"]["records"]}
            vals = [(by.get(n) or {}).get("vs_torch_best") or 0.0 for n in names]
            ax2.bar([i - 0.4 + w * (k + 0.5) for i in range(len(names))], vals, w, label=f"{p['rate_mbit']:g} Mbit/s")
        ax2.axhline(1.0, color="grey", ls=":", lw=1)
        ax2.set_xticks(range(len(names)))
        ax2.set_xticklabels(names, rotation=35, ha="right", fontsize=7)
        ax2.set_ylabel(f"throughput / torch's best (tp {tp})")
        ax2.legend(fontsize=7, ncol=len(pts))
        pp = grid["pp"]
        w = 0.8 / pp
        for st in range(pp):
            vals = []
            for n in names:
                rec = next((r for p in done for r in p["run"]["records"] if r["name"] == n and r["status"] == "ok"), {})
                vals.append(((rec.get("act_peak_bytes") or [0] * pp)[st] or 0) / 2 ** 20)
            ax3.bar([i - 0.4 + w * (st + 0.5) for i in range(len(names))], vals, w, label=f"stage {st}")
        ax3.set_xticks(range(len(names)))
        ax3.set_xticklabels(names, rotation=35, ha="right", fontsize=7)
        ax3.set_ylabel("peak saved activations, MiB")
        ax3.legend(fontsize=7, ncol=pp)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
