"""Draw a traced resharding run (``bench_resharding --trace-dir``): one lane per host NIC side, one bar per wire
operation from its post to its completion, coloured by task, with the network lower bound marked.

    python -m lab.bench.reshard_timeline TRACE.json -o timeline.png

A receive posted early waits for its sender, so a recv bar starts at its post, not at its first byte; the send
bars of a host's side show what its NIC carried. The summary printed per host side: the time from the run's
first post to the side's last completion, and the part of it covered by at least one operation (busy)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def lanes(doc: dict[str, Any]) -> dict[tuple[int, str], list[dict[str, Any]]]:
    """(host, side) -> its events, times relative to the run's first post."""
    t0 = min(e["t_post"] for e in doc["events"])
    out: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for e in doc["events"]:
        out.setdefault((e["host"], e["side"]), []).append({**e, "t_post": e["t_post"] - t0, "t_done": e["t_done"] - t0})
    return dict(sorted(out.items()))


def busy(spans: list[tuple[float, float]]) -> float:
    """Length of the union of the spans."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summary(doc: dict[str, Any]) -> list[str]:
    out = []
    for (host, side), evs in lanes(doc).items():
        last = max(e["t_done"] for e in evs)
        cover = busy([(e["t_post"], e["t_done"]) for e in evs])
        out.append(f"host {host} {side}: {len(evs)} operations, last done at {last:.3f} s, covered {cover:.3f} s "
                   f"({cover / doc['lower_bound_s']:.2f}× the bound)")
    return out


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ls = lanes(doc)
    tasks = sorted({t["pos"] for t in doc["tasks"]})
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(13, 0.5 * len(ls) + 1.6))
    for y, ((host, side), evs) in enumerate(ls.items()):
        ranks = sorted({e["rank"] for e in evs})
        h = 0.8 / len(ranks)
        for e in evs:
            k = ranks.index(e["rank"])
            ax.barh(y - 0.4 + (k + 0.5) * h, e["t_done"] - e["t_post"], left=e["t_post"], height=h * 0.9,
                    color=cmap(tasks.index(e["pos"]) % 20), edgecolor="black", linewidth=0.3)
    ax.axvline(doc["lower_bound_s"], color="black", linestyle="--", linewidth=1, label="network lower bound")
    ax.axvline(doc["seconds_traced"], color="red", linewidth=1, label="this run (first post to last barrier)")
    ax.set_yticks(range(len(ls)), [f"host {h} {s}" for h, s in ls])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the first post (bars: one wire operation, post to completion; colour: task; "
                  "a lane's rows: its ranks)")
    ax.set_title(f"{doc['case']} {doc['strategy']}/{doc['scheduler']} ({doc['scheduler_used']}) {doc['order']}: "
                 f"{doc['seconds_traced']:.3f} s traced, {doc['seconds_median_untraced']:.3f} s untraced median, "
                 f"bound {doc['lower_bound_s']:.3f} s at {doc['nic_gbps']:g} Gbit/s")
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a JSON written by bench_resharding --trace-dir")
    ap.add_argument("-o", "--out", default=None, help="PNG to write")
    a = ap.parse_args(argv)
    try:
        doc = json.loads(Path(a.trace).read_text())
    except (OSError, ValueError) as e:
        print(f"reshard_timeline: {a.trace}: {e}", file=sys.stderr)
        return 2
    if not doc.get("events"):
        print(f"reshard_timeline: {a.trace}: no wire operations traced", file=sys.stderr)
        return 2
    print("\n".join(summary(doc)))
    if a.out:
        plot(doc, a.out)
        print(f"picture: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
