#!/usr/bin/env python
"""Redraw the GPU speed grid's table and picture from the JSON that ``lab.bench.gpu_checks`` wrote.

    python -m lab.bench.gpu_report docs/results/gpu_h200_fast_path.json docs/results/gpu_h200_fast_path_rerun.json \
        --plot docs/img/gpu_fast_path.png

    python -m lab.bench.gpu_report docs/results/gpu_h200_issue53.json docs/results/gpu_h200_issue53_grid.json \
        --merge --plot docs/img/gpu_issue53.png

One run or several of the same grid (reruns on the same card), or with ``--merge`` the parts of one grid run
in several launches on one machine (each model once): the table gives each model and variant, each
cell the runs in order (tokens/s, TFLOP/s, MFU against the datasheet peak and the measured matrix-product rate, the
ratios to the lean single-file peer compiled (``vs lean``, issue #53's reference) and to transformers +
torch.compile of the same run, peak memory, compile seconds); the picture plots each variant's tokens/s relative
to lean-compile (or, for runs from before the lean peer, to transformers + torch.compile), one marker per run,
beside the MFU against the datasheet peak and the run's targets.
"""
from __future__ import annotations

import argparse
import json
import os

ORDER = ("megareshard-cli", "megareshard-fast", "megareshard-eager", "megareshard-fast-unfused-ce", "lean-compile",
         "lean-eager", "hf-compile", "hf-eager")
#: the MFU targets of the runs from before the JSON carried its own (``targets``)
OLD_MFU_TARGETS = {"gpt-125m": 0.40, "gpt-1.3b": 0.50, "llama-1.2b": 0.45}


def variants(runs: list[dict]) -> list[str]:
    """The variants the runs hold, in ORDER (any other after them)."""
    seen = list(dict.fromkeys(p["variant"] for run in runs for p in run["points"]))
    return [v for v in ORDER if v in seen] + [v for v in seen if v not in ORDER]


def load(paths: list[str], merge: bool = False) -> list[dict]:
    """One run per file; ``merge``: the files are parts of one grid (their points joined, a model and variant
    measured twice refused), one run named after them all, the first file's ceilings."""
    runs = []
    for path in paths:
        data = json.load(open(path))
        runs.append({"name": os.path.basename(path), "ceilings": data["ceilings"], "peak": data["peak_tflops"],
                     "points": data["speed"]["points"],
                     "mfu_targets": data.get("targets", {}).get("mfu_vs_peak", OLD_MFU_TARGETS)})
    if not merge or len(runs) < 2:
        return runs
    seen = [(p["model"], p["variant"]) for run in runs for p in run["points"] if p.get("status") == "ok"]
    twice = sorted({k for k in seen if seen.count(k) > 1})
    if twice:
        raise ValueError(f"--merge: {', '.join(f'{m} {v}' for m, v in twice)} measured in more than one file: "
                         "reruns, not parts of one grid")
    points = [p for run in runs for p in run["points"] if p.get("status") == "ok"]
    points += [p for run in runs for p in run["points"] if p.get("status") != "ok"
               and (p["model"], p["variant"]) not in seen]
    return [dict(runs[0], name=" + ".join(r["name"] for r in runs), points=points)]


def table(runs: list[dict]) -> str:
    """One row per model and variant; with several runs each cell gives them in order, "run 1 / run 2"."""
    rows = ["| model | variant | tokens/s | TFLOP/s | MFU vs peak | vs measured | vs lean | vs HF compile | peak GiB | "
            "compile s |", "|---|---|---|---|---|---|---|---|---|---|"]
    models = list(dict.fromkeys(p["model"] for run in runs for p in run["points"]))
    for model in models:
        for variant in variants(runs):
            recs = [next((r for r in run["points"] if r["model"] == model and r["variant"] == variant), None)
                    for run in runs]
            if any(r is None or r.get("status") != "ok" for r in recs):
                why = "; ".join(f"run {i}: {r.get('status')} {r.get('error', '')}".strip() if r else f"run {i}: absent"
                                for i, r in enumerate(recs, 1) if r is None or r.get("status") != "ok")
                rows.append(f"| {model} | {variant} | {why} | | | | | | | |")
                continue

            def both(key: str, fmt: str = "{:.0f}", scale: float = 1.0) -> str:
                return " / ".join(fmt.format(r[key] * scale) if r.get(key) is not None else "-" for r in recs)
            rows.append(f"| {model} | {variant} | {both('tokens_per_s')} | {both('tflops')} | "
                        f"{both('mfu_vs_peak', '{:.1f}', 100)} % | {both('mfu_vs_measured', '{:.1f}', 100)} % | "
                        f"{both('vs_lean', '{:.3f}')} | {both('vs_hf_compile', '{:.3f}')} | "
                        f"{both('peak_mem_gib', '{:.1f}')} | {both('compile_s')} |")
    return "\n".join(rows)


def plot(runs: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(p["model"] for run in runs for p in run["points"]))
    names = [v for v in variants(runs) if any(p["variant"] == v and p.get("status") == "ok"
                                              for run in runs for p in run["points"])]
    colors = {"megareshard-cli": "tab:blue", "megareshard-fast": "tab:cyan", "megareshard-eager": "tab:gray",
              "lean-compile": "tab:green", "lean-eager": "tab:olive", "hf-compile": "tab:orange",
              "hf-eager": "tab:brown"}
    lean = any("vs_lean" in p for run in runs for p in run["points"])
    ratio = "vs_lean" if lean else "vs_hf_compile"
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.7 / max(len(names), 1)
    for ax, key, label in ((axes[0], ratio, "tokens/s ÷ " + ("the lean peer, compiled" if lean else
                                                              "transformers + torch.compile") + " (same run)"),
                           (axes[1], "mfu_vs_peak", "MFU against the datasheet peak (989 TFLOP/s)")):
        for j, variant in enumerate(names):
            for k, run in enumerate(runs):
                xs, ys = [], []
                for m, model in enumerate(models):
                    for r in run["points"]:
                        if r["model"] == model and r["variant"] == variant and r.get("status") == "ok" \
                                and r.get(key) is not None:
                            xs.append(m + (j - (len(names) - 1) / 2) * width)
                            ys.append(r[key] * (100 if key == "mfu_vs_peak" else 1))
                ax.scatter(xs, ys, color=colors.get(variant, "black"), marker="o" if k == 0 else "x", s=28,
                           label=f"{variant} (run {k + 1})")
        ax.set_xticks(range(len(models)), models, rotation=20)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].axhline(1.0, color="black", lw=0.8, ls="--")
    axes[1].set_ylim(0, 70)
    targets = runs[0]["mfu_targets"]
    for m, model in enumerate(models):
        if model in targets:
            axes[1].plot([m - 0.4, m + 0.4], [100 * targets[model]] * 2, color="red", lw=1.2)
    axes[1].plot([], [], color="red", lw=1.2, label="MFU target")
    axes[1].legend(fontsize=6, loc="lower right", ncol=2)
    dev = runs[0]["ceilings"].get("device", "?")
    fig.suptitle(f"{dev}, bf16, sequence 2048: " + ", ".join(names), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+", help="gpu_checks.json files of the same grid (reruns)")
    p.add_argument("--plot", help="PNG to draw")
    p.add_argument("--merge", action="store_true", help="the files are parts of one grid (each point once)")
    a = p.parse_args()
    try:
        runs = load(a.json, a.merge)
    except ValueError as e:
        p.error(str(e))
    print(table(runs))
    if a.plot:
        plot(runs, a.plot)
        print(f"[gpu_report] wrote {a.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
