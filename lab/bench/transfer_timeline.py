"""Draw the per-NIC timelines of a weight-transfer benchmark (``lab.bench.bench_weight_transfer --out JSON``): one
panel per (method, shape), each host's NIC send and receive rate over the sampled run, the NIC goodput and the
floor (the bytes each generator host must receive at least once, over that goodput) marked.

    python -m lab.bench.transfer_timeline docs/results/weight_transfer_1gbit.json -o docs/img/weight_transfer.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

METHODS = ("planned", "round_robin", "per_param", "dcp")
LABELS = {"planned": "megareshard planned", "round_robin": "round-robin p2p (Megatron-Core refit)",
          "per_param": "per-parameter sends", "dcp": "DCP save + copy + load"}


def rates(samples: list[list[float]], window: float = 0.05) -> tuple[list[float], list[float], list[float]]:
    """(times, send Gbit/s, receive Gbit/s): byte-counter differences over ``window`` seconds."""
    ts, tx, rx = [], [], []
    j = 0
    for i, (t, s, r) in enumerate(samples):
        while samples[j][0] < t - window:
            j += 1
        dt = t - samples[j][0]
        if dt <= 0:
            continue
        ts.append(t)
        tx.append((s - samples[j][1]) * 8 / dt / 1e9)
        rx.append((r - samples[j][2]) * 8 / dt / 1e9)
    return ts, tx, rx


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(doc["shapes"])
    methods = [m for m in METHODS if any(m in doc["shapes"][s]["methods"] for s in shapes)]
    fig, axes = plt.subplots(len(methods), len(shapes), figsize=(7 * len(shapes), 2.3 * len(methods) + 0.8),
                             squeeze=False, sharey=True)
    colors = plt.get_cmap("tab10")
    tmax = max(b["traced_s"] for s in shapes for b in doc["shapes"][s]["methods"].values())
    for c, sh in enumerate(shapes):
        e = doc["shapes"][sh]
        for r, m in enumerate(methods):
            ax = axes[r][c]
            box = e["methods"].get(m)
            if box is None:
                ax.set_visible(False)
                continue
            for h, smp in sorted(box["nic_samples"].items(), key=lambda kv: int(kv[0])):
                ts, tx, rx = rates(smp)
                ax.plot(ts, tx, color=colors(int(h)), linewidth=1, label=f"host {h} send")
                ax.plot(ts, rx, color=colors(int(h)), linewidth=1, linestyle="--", label=f"host {h} receive")
            ax.axhline(doc["nic_gbps_measured"], color="grey", linewidth=0.8, linestyle=":")
            ax.axvline(e["floor_s"], color="black", linewidth=1, linestyle=":")
            ax.set_xlim(0, tmax * 1.02)
            ax.set_title(f"shape {sh}, {LABELS.get(m, m)}: {box['traced_s']:.2f} s (median {box['seconds']:.2f} s)",
                         fontsize=9)
            if c == 0:
                ax.set_ylabel("Gbit/s")
            if r == len(methods) - 1:
                ax.set_xlabel("seconds from the run's start (dotted: the floor; grey: NIC goodput)")
    h, lab = axes[0][0].get_legend_handles_labels()
    fig.legend(h, lab, loc="upper center", ncol=8, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="a JSON written by bench_weight_transfer --out")
    ap.add_argument("-o", "--out", required=True, help="PNG to write")
    a = ap.parse_args(argv)
    try:
        doc = json.loads(Path(a.json).read_text())
    except (OSError, ValueError) as e:
        print(f"transfer_timeline: {a.json}: {e}", file=sys.stderr)
        return 2
    if not any(b.get("nic_samples") for s in doc["shapes"].values() for b in s["methods"].values()):
        print(f"transfer_timeline: {a.json}: no NIC samples (was it run on the emulated cluster?)", file=sys.stderr)
        return 2
    plot(doc, a.out)
    print(f"picture: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
