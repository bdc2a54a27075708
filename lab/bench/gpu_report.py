#!/usr/bin/env python
"""Redraw the GPU speed grid's table and picture from the JSON that ``lab.bench.gpu_checks`` wrote.

    python -m lab.bench.gpu_report docs/results/gpu_h200_fast_path.json docs/results/gpu_h200_fast_path_rerun.json \
        --plot docs/img/gpu_fast_path.png

One run or several of the same grid (reruns on the same card): the table gives each model and variant, each
cell the runs in order (tokens/s, TFLOP/s, MFU against the datasheet peak and the measured matrix-product rate, the ratio to
transformers + torch.compile of the same run, peak memory, compile seconds); the picture plots each variant's
tokens/s relative to transformers + torch.compile, one marker per run, beside the MFU against the datasheet peak.
"""
from __future__ import annotations

import argparse
import json
import os

ORDER = ("megareshard-eager", "megareshard-fast", "hf-compile")


def load(paths: list[str]) -> list[dict]:
    runs = []
    for path in paths:
        data = json.load(open(path))
        runs.append({"name": os.path.basename(path), "ceilings": data["ceilings"], "peak": data["peak_tflops"],
                     "points": data["speed"]["points"]})
    return runs


def table(runs: list[dict]) -> str:
    """One row per model and variant; with several runs each cell gives them in order, "run 1 / run 2"."""
    rows = ["| model | variant | tokens/s | TFLOP/s | MFU vs peak | vs measured | vs HF compile | peak GiB | "
            "compile s |", "|---|---|---|---|---|---|---|---|---|"]
    models = list(dict.fromkeys(p["model"] for run in runs for p in run["points"]))
    cell = {"tokens_per_s": "{:.0f}", "tflops": "{:.0f}", "vs_hf_compile": "{:.3f}", "compile_s": "{:.0f}"}
    for model in models:
        for variant in ORDER:
            recs = [next((r for r in run["points"] if r["model"] == model and r["variant"] == variant), None)
                    for run in runs]
            if any(r is None or r.get("status") != "ok" for r in recs):
                why = "; ".join(f"run {i}: {r.get('status')} {r.get('error', '')}".strip() if r else f"run {i}: absent"
                                for i, r in enumerate(recs, 1) if r is None or r.get("status") != "ok")
                rows.append(f"| {model} | {variant} | {why} | | | | | | |")
                continue

            def both(key: str, fmt: str = "{:.0f}", scale: float = 1.0) -> str:
                return " / ".join(fmt.format(r[key] * scale) if r.get(key) is not None else "-" for r in recs)
            rows.append(f"| {model} | {variant} | {both('tokens_per_s')} | {both('tflops')} | "
                        f"{both('mfu_vs_peak', '{:.1f}', 100)} % | {both('mfu_vs_measured', '{:.1f}', 100)} % | "
                        f"{both('vs_hf_compile', '{:.3f}')} | {recs[0]['peak_mem_gib']:.1f} | {both('compile_s')} |")
    return "\n".join(rows)


def plot(runs: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(p["model"] for run in runs for p in run["points"]))
    colors = {"megareshard-eager": "tab:gray", "megareshard-fast": "tab:blue", "hf-compile": "tab:orange"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, label in ((axes[0], "vs_hf_compile", "tokens/s ÷ transformers + torch.compile (same run)"),
                           (axes[1], "mfu_vs_peak", "MFU against the datasheet peak (989 TFLOP/s)")):
        for j, variant in enumerate(ORDER):
            for k, run in enumerate(runs):
                xs, ys = [], []
                for m, model in enumerate(models):
                    for r in run["points"]:
                        if r["model"] == model and r["variant"] == variant and r.get("status") == "ok" \
                                and r.get(key) is not None:
                            xs.append(m + (j - 1) * 0.22)
                            ys.append(r[key] * (100 if key == "mfu_vs_peak" else 1))
                ax.scatter(xs, ys, color=colors[variant], marker="o" if k == 0 else "x", s=28,
                           label=f"{variant} (run {k + 1})")
        ax.set_xticks(range(len(models)), models, rotation=20)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].axhline(1.0, color="black", lw=0.8, ls="--")
    axes[1].set_ylim(0, 70)
    targets = {"gpt-125m": 40, "gpt-1.3b": 50, "llama-1.2b": 45}
    for m, model in enumerate(models):
        if model in targets:
            axes[1].plot([m - 0.4, m + 0.4], [targets[model]] * 2, color="red", lw=1.2)
    axes[1].plot([], [], color="red", lw=1.2, label="MFU target")
    axes[1].legend(fontsize=6, loc="lower right", ncol=2)
    dev = runs[0]["ceilings"].get("device", "?")
    fig.suptitle(f"{dev}, bf16, sequence 2048: megareshard eager / fast path against transformers + torch.compile",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+", help="gpu_checks.json files of the same grid (reruns)")
    p.add_argument("--plot", help="PNG to draw")
    a = p.parse_args()
    runs = load(a.json)
    print(table(runs))
    if a.plot:
        plot(runs, a.plot)
        print(f"[gpu_report] wrote {a.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
