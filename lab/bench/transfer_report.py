"""The weight-transfer benchmark's tables and target verdicts, from its JSON (`bench_weight_transfer --out`): pure,
no processes. ``python -m lab.bench.transfer_report JSON`` prints the markdown docs/benchmarks.md shows.

Targets (issue #50): the planned transfer ≤ 1.2× the network lower bound in both shapes; ≥ 3× faster than
per-parameter sends; ≥ 1.5× faster than the round-robin point-to-point plan where a source shard has ≥ 2
destination replicas (both shapes here); faster than the DCP round trip; staging within ``--bucket-mb``."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

RESULT = "weight_transfer_1gbit.json"  # the run the tables quote (docs/results/)
RUNS = "weight_transfer_runs.json"  # every run started, summarised
ORDER = ("planned", "round_robin", "per_param", "dcp")
NAMES = {"planned": "megareshard (planned)", "round_robin": "round-robin point-to-point (Megatron-Core refit)",
         "per_param": "per-parameter sends, one rank per stage", "dcp": "DCP save + copy + load"}


def verdicts(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (target, shape): value, limit, met."""
    out = []
    for sh, e in doc["shapes"].items():
        m = e["methods"]
        ours = m["planned"]["seconds"]
        out.append({"target": "planned / lower bound", "shape": sh, "value": ours / e["plan"]["bound_s"],
                    "limit": 1.2, "met": ours / e["plan"]["bound_s"] <= 1.2})
        for k, limit in (("per_param", 3.0), ("round_robin", 1.5), ("dcp", 1.0)):
            if k in m:
                v = m[k]["seconds"] / ours
                out.append({"target": f"{k} / planned", "shape": sh, "value": v, "limit": limit,
                            "met": v > limit if k == "dcp" else v >= limit})
        peak = m["planned"].get("staging_bytes_peak")
        if peak is not None:
            bound = doc["bucket_mb"] * 2**20
            out.append({"target": "staging / bound", "shape": sh, "value": peak / bound, "limit": 1.0,
                        "met": peak <= bound})
    return out


def table(doc: dict[str, Any]) -> str:
    gb = doc["nic_gbps_measured"]
    lines = [f"Model: {doc['model']['tensors']} tensors, {doc['model']['bytes'] / 2**20:.1f} MiB fp32; NIC goodput "
             f"{gb:.3f} Gbit/s (nominal {doc['nic_gbps_nominal']:g}); staging bound {doc['bucket_mb']:g} MiB; "
             f"median of {doc['repeat']} runs.", ""]
    for sh, e in doc["shapes"].items():
        reps = ", ".join(f"{r['name']} (tp {r['tp']}, ranks {','.join(map(str, r['ranks']))})" for r in e["replicas"])
        lines += [f"**Shape {sh}**: {reps}. Floor (each generator host receives every byte its replicas need once): "
                  f"{e['floor_s']:.3f} s; the planned transfer's own bound {e['plan']['bound_s']:.3f} s.", "",
                  "| method | median s | runs (s) | busiest NIC side's bound, s | × floor | planned is faster by |",
                  "|---|---|---|---|---|---|"]
        ours = e["methods"]["planned"]["seconds"]
        for k in ORDER:
            b = e["methods"].get(k)
            if b is None:
                continue
            speed = "—" if k == "planned" else f"{b['seconds'] / ours:.2f}×"
            lines.append(f"| {NAMES[k]} | {b['seconds']:.3f} | {', '.join(f'{t:.3f}' for t in b['repeats'])} | "
                         f"{b['bound_s']:.3f} | {b['seconds'] / e['floor_s']:.2f} | {speed} |")
        d = e["methods"].get("dcp")
        if d is not None:
            lines += ["", f"DCP phases (median): save + load alone {d['save_load_s']:.3f} s (what a shared disk "
                      "would cost, no copy)."]
        lines.append("")
    lines += ["| target | shape | measured | limit | holds |", "|---|---|---|---|---|"]
    for v in verdicts(doc):
        lines.append(f"| {v['target']} | {v['shape']} | {v['value']:.2f} | {v['limit']:g} | "
                     f"{'yes' if v['met'] else '**no**'} |")
    return "\n".join(lines)


def runs_table(runs: list[dict[str, Any]]) -> str:
    """Every run of the benchmark started (``weight_transfer_runs.json``): the planned transfer over its bound,
    and how much faster it was than each other method, per shape."""
    lines = ["| run | what changed | A: planned × bound | B: planned × bound | A: vs round-robin, per-parameter, DCP "
             "| B: vs round-robin, per-parameter, DCP |", "|---|---|---|---|---|---|"]
    for r in runs:
        cells = []
        for sh in ("A", "B"):
            e = r["shapes"][sh]
            cells.append(f"{e['planned_over_bound']:.2f}")
        for sh in ("A", "B"):
            m = r["shapes"][sh]["methods"]
            ours = m["planned"]["seconds"]
            cells.append(", ".join(f"{m[k]['seconds'] / ours:.2f}×" if k in m else "—"
                                   for k in ("round_robin", "per_param", "dcp")))
        lines.append(f"| {r['run']} | {r['design']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--runs", action="store_true", help="JSON is weight_transfer_runs.json: print every run's row")
    a = ap.parse_args(argv)
    try:
        doc = json.loads(Path(a.json).read_text())
    except (OSError, ValueError) as e:
        print(f"transfer_report: {a.json}: {e}", file=sys.stderr)
        return 2
    print(runs_table(doc) if a.runs else table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
