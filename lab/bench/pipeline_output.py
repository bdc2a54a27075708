"""What lab/bench/bench_pipeline.py writes: the Markdown table, the JSON, the traces and the pictures.

``format_table`` (one Markdown table of a run's records, also every grid point's), ``write_json`` (through a
temporary file, so no reader sees half a file), ``write_traces`` (each configuration's timeline),
``plot_bars`` (ms/iteration per configuration) and ``plot_compare`` (measured timelines stacked, paper
Figure 4); ``finish`` prints and writes all that a run's flags ask for.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from lab.bench.pipeline_args import BenchConfig, parse_config


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """One Markdown table of a run's records (ready to paste into docs/benchmarks.md)."""
    def pct(v):
        return "-" if v is None else f"{v:.0%}"

    def x(v):
        return "-" if v is None else f"{v:.2f}×"

    r0 = records[0]
    head = ["config", "ms/iter median", "q1–q3", "min", f"vs {r0['baseline']} (median / paired / min)",
            "gap closure", "of signal, same schedule (median / paired / min)", "of best signal",
            "physical bound ms (binding)", "of physical bound", "gap closure vs physical", "model ms / transfer",
            "peak in flight per stage (measured / simulated)", "peak activations MiB per stage (measured)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if r0.get("status") not in (None, "complete"):  # a stopped (or still running) launch: say so first
        lines.insert(0, f"*{r0['status']} after {r0.get('rounds_done')} of {r0.get('rounds_planned')} timed rounds"
                        + (f" ({r0['stop_reason']})" if r0.get("stop_reason") else "") + "*\n")
    for r in records:
        sig = f"{pct(r['signal_fraction'])} / {pct(r.get('signal_fraction_paired'))} / {pct(r.get('signal_fraction_min'))}"
        if r.get("void"):
            sig = f"**void** ({sig})"
        row = [r["config"], f"{r['ms_per_iter']:.0f}", f"{r['ms_q1']:.0f}–{r['ms_q3']:.0f}",
               f"{r.get('ms_min', r['ms_per_iter']):.0f}",
               f"{x(r['speedup_vs_baseline'])} / {x(r.get('speedup_vs_baseline_paired'))} / "
               f"{x(r.get('speedup_vs_baseline_min'))}",
               "-" if r["strategy"] == "signal" or r["config"] == r["baseline"] else pct(r.get("gap_closure")),
               sig, pct(r["best_signal_fraction"]), _physical_cell(r),
               (f"**void** ({pct(r.get('physical_fraction'))})" if r.get("physical_void")
                else pct(r.get("physical_fraction"))),
               "-" if r["config"] == r["baseline"] else pct(r.get("physical_gap_closure")),
               f"{r['transfer_model_ms']:.1f}",
               " / ".join(",".join(map(str, v)) if v else "-" for v in (r.get("peak_inflight_measured"),
                                                                         r.get("peak_inflight_simulated"))),
               ",".join(f"{b / 2**20:.1f}" for b in r["peak_activation_bytes_measured"])
               if r.get("peak_activation_bytes_measured") else "-"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _physical_cell(r: dict[str, Any]) -> str:
    pb = r.get("physical")
    return "-" if not pb else f"{pb['bound_ms']:.0f} ({pb['binding']})"


def write_traces(trace_dir: str, configs: Sequence[BenchConfig], traces: Sequence[list[dict[str, Any]] | None],
                 suffix: str = "") -> None:
    """Each configuration's trace as ``CONFIG{suffix}.json`` in `trace_dir` (configurations without one: none)."""
    from megareshard.pipeline.runtime import write_trace

    os.makedirs(trace_dir, exist_ok=True)
    for c, tr in zip(configs, traces):
        if tr:
            write_trace(os.path.join(trace_dir, f"{c.name}{suffix}.json"), tr)


def finish(a: argparse.Namespace, records: list[dict[str, Any]], traces: Sequence[list[dict[str, Any]] | None],
           configs: Sequence[BenchConfig]) -> None:
    print(format_table(records), flush=True)
    if a.json:
        write_json(a.json, records)
        print(f"[bench_pipeline] records: {a.json}", file=sys.stderr)
    if a.trace_dir:
        write_traces(a.trace_dir, configs, traces)
        print(f"[bench_pipeline] traces: {a.trace_dir}/CONFIG.json (tools/plot_schedule.py --trace FILE -o X.png)",
              file=sys.stderr)
    if a.plot:
        plot_bars(records, a.plot)
        print(f"[bench_pipeline] picture: {a.plot}", file=sys.stderr)
    if a.compare_plot:
        names = [parse_config(x).name for x in a.compare.split(",") if x.strip()]
        by = {c.name: tr for c, tr in zip(configs, traces)}
        missing = [n for n in names if not by.get(n)]
        if missing:
            print(f"[bench_pipeline] --compare-plot: no trace for {', '.join(missing)}; skipped", file=sys.stderr)
        else:
            plot_compare([(n, by[n]) for n in names], records, a.compare_plot)
            print(f"[bench_pipeline] timelines: {a.compare_plot}", file=sys.stderr)


def write_json(path: str, data: Any) -> None:
    """Write `data` as JSON to `path` through a temporary file beside it, so a reader (or a run stopped
    half-way through a write) never sees half a file."""
    tmp = f"{path}.part"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def plot_bars(records: Sequence[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"sendrecv": "#c44e52", "allgather": "#dd8452", "broadcast": "#4c72b0", "signal": "#bbbbbb"}
    names = [r["config"] for r in records]
    ms = [r["ms_per_iter"] for r in records]
    err = [[m - r["ms_q1"] for m, r in zip(ms, records)], [r["ms_q3"] - m for m, r in zip(ms, records)]]
    fig, ax = plt.subplots(figsize=(2.0 + 1.05 * len(records), 4.2))
    bars = ax.bar(range(len(records)), ms, yerr=err, capsize=3, color=[colors[r["strategy"]] for r in records],
                  edgecolor="black", linewidth=0.6)
    for bar, r in zip(bars, records):
        if r["delay_wgrad"]:
            bar.set_hatch("//")
        lines = []
        if r["speedup_vs_baseline"] is not None:
            lines.append(f"{r['speedup_vs_baseline']:.2f}x")
        if r["strategy"] != "signal" and r["signal_fraction"] is not None:
            lines.append(f"{r['signal_fraction']:.0%} sig")
        ax.text(bar.get_x() + bar.get_width() / 2, r["ms_q3"] + 0.01 * max(ms),
                "\n".join(lines), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(records)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per iteration (median, q1–q3)")
    r0 = records[0]
    ax.set_title(f"{r0['model']} pp {r0['pp']} × tp {r0['tp']} × dp {r0['dp']}, {r0['microbatches']} microbatches, "
                 f"NIC {r0['nic_gbps']:g} Gbit/s ({r0['mode']}); labels: speedup vs {r0['baseline']}, "
                 "fraction of the signal bound", fontsize=8)
    ax.set_ylim(0, max(ms) * 1.25 + max(err[1]))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_compare(named: Sequence[tuple[str, list[dict[str, Any]]]], records: Sequence[dict[str, Any]],
                 path: str) -> None:
    """Measured timelines stacked (paper Figure 4), one common time axis in ms."""
    from megareshard.pipeline import Timeline
    from megareshard.pipeline.draw import draw

    by = {r["config"]: r for r in records}
    tls = []
    for name, tr in named:
        ms = [{**x, "start": 1e3 * x["start"], "end": 1e3 * x["end"]} for x in tr]
        r = by.get(name)
        label = name if r is None else f"{name} (median {r['ms_per_iter']:.0f} ms/iter)"
        tls.append(Timeline.from_trace(ms, name=label))
    draw(tls, Path(path), 0.0, "ms")
