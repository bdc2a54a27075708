"""Operating points of the benchmark grids, and choosing them with the simulator before any run.

A point is a NIC rate and, optionally, a changed shape: ``RATE[:m=MICROBATCHES][:seq=SEQ_LENGTH][:tp=TP]``
(``20:m=16`` = 20 Mbit/s with 16 microbatches). The grids' points are fixed in code (``GRID_POINTS``,
``PEER_POINTS``) and written in docs/benchmarks.md before the first run; ``--choose-points`` prints, for
every candidate, what the simulator predicts — the Megatron-style baseline's and the full method's time, each
one's physical bound (`physical_bound.py`) and fraction of it, and the point's wall time — so the choice can
be redone by anyone: the points where the baseline is predicted below ``COMM_MATTERS`` of its physical bound
are where communication matters; those where the baseline is above that and its bound with free transfers
(compute and the compute-only fill and drain) is at least ``COMPUTE_BOUND`` of its physical bound are
compute-bound. The point's wall time is `estimate_point_s`'s (the simulator's iteration times; the last grid
measured about a third more at 10 Mbit/s, where the unpaced warm-up rounds wait on the network).

Costs for the prediction: the paced budgets of a committed run (the highest-rate complete point of the
model's grid JSON: the least waiting in its calibration rounds), scaled by the tokens a microbatch carries
when a point changes the sequence length (a transformer layer's work is nearly linear in tokens at these
sizes: an assumption for choosing points, not a fitted constant; the run recalibrates its own budgets).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
from typing import Any, Callable, Sequence

__all__ = ["parse_points", "point_label", "apply_point", "reference_costs", "scale_costs", "COMM_MATTERS",
           "COMPUTE_BOUND", "GRID_POINTS", "PEER_POINTS", "CANDIDATES", "classify"]

COMM_MATTERS = 0.90  # the baseline below this fraction of its physical bound: communication matters
COMPUTE_BOUND = 0.95  # the baseline's bound with free transfers at least this fraction of its physical bound, and
# the baseline at least COMM_MATTERS of it: a compute-bound point

# Chosen with --choose-points before running (docs/benchmarks.md, "fixed before running").
GRID_POINTS = {
    "gpt": "10,20,40,40:m=16,160,320",
    "utransformer": "10,20,40,20:m=16,160,320",
}
PEER_POINTS = "10:tp=1,20:tp=1,40:tp=1,80:tp=1,160:tp=1,320:tp=1,10:tp=2,20:tp=2,160:tp=2"
CANDIDATES = "5,10,20,40,80,160,320,10:m=16,20:m=16,40:m=16,20:seq=512,40:seq=512,80:seq=512"
PEER_CANDIDATES = ",".join(f"{r}:tp={t}" for t in (1, 2) for r in (5, 10, 20, 40, 80, 160, 320))

_KEYS = {"m": "microbatches", "seq": "seq_length", "tp": "tp"}


def parse_points(text: str) -> list[dict[str, Any]]:
    """``RATE[:m=M][:seq=S][:tp=T],...`` -> points ``{"rate_mbit", "overrides", "label"}``, in the order given."""
    out, seen = [], set()
    for part in [x.strip() for x in text.split(",") if x.strip()]:
        head, *opts = part.split(":")
        try:
            rate = float(head)
            over = {}
            for o in opts:
                k, v = o.split("=")
                over[_KEYS[k]] = int(v)
        except (ValueError, KeyError):
            raise ValueError(f"--points {text!r}: {part!r} is not RATE[:m=MICROBATCHES][:seq=SEQ_LENGTH][:tp=TP] "
                             "(Mbit/s, then integers)") from None
        if rate <= 0 or any(v < 1 for v in over.values()) or part in seen:
            raise ValueError(f"--points {text!r}: {part!r} needs a rate > 0, values >= 1, and to appear once")
        seen.add(part)
        out.append({"rate_mbit": rate, "overrides": over, "label": point_label(rate, over), "text": part})
    if not out:
        raise ValueError(f"--points {text!r}: no point")
    return out


def point_label(rate: float, overrides: dict[str, int]) -> str:
    names = {"microbatches": "m", "seq_length": "seq", "tp": "tp"}
    return f"{rate:g}" + "".join(f" {names[k]} {v}" for k, v in sorted(overrides.items()))


def apply_point(a: argparse.Namespace, point: dict[str, Any]) -> argparse.Namespace:
    """A copy of the arguments at `point`: its rate as ``nic_gbps``, its shape changes."""
    pa = copy.copy(a)
    pa.nic_gbps = point["rate_mbit"] / 1e3
    for k, v in point["overrides"].items():
        setattr(pa, k, v)
    return pa


def reference_costs(path: str, pp: int, tp: int | None = None) -> tuple[dict[str, list[float]], str]:
    """Per-stage F/B/I/W ms of a committed run: the highest-rate complete point of a bench_pipeline grid JSON
    (its ``pace_ms``), or of a bench_peers grid JSON at `tp` (its ``budgets_ms``); and where they came from."""
    data = json.load(open(path))
    pts = [p for p in data.get("points", []) if p.get("status") == "complete" and (tp is None or p.get("tp") == tp)]
    for p in sorted(pts, key=lambda p: -p["rate_mbit"]):
        budgets = (p.get("run") or {}).get("budgets_ms") or next(
            (r.get("pace_ms") for r in p.get("records") or [] if r.get("pace_ms")), None)
        if budgets and len(budgets) == pp and all(all(k in b for k in "FBIW") for b in budgets):
            where = f"{os.path.basename(path)} at {p['rate_mbit']:g} Mbit/s" + (f", tp {tp}" if tp else "")
            return {k.lower(): [b[k] for b in budgets] for k in "FBIW"}, where
    raise ValueError(f"{path}: no complete point with paced budgets for {pp} stages" + (f" at tp {tp}" if tp else ""))


def scale_costs(costs: dict[str, list[float]], factor: float) -> dict[str, list[float]]:
    return {k: [x * factor for x in v] for k, v in costs.items()}


def classify(base: dict[str, Any]) -> str:
    """A point's kind from the baseline's predicted record: "comm" (below COMM_MATTERS of its physical bound),
    "compute" (at least COMM_MATTERS of it, and its bound with free transfers at least COMPUTE_BOUND of the
    bound), else "between"."""
    frac, pb = base.get("physical_fraction"), base.get("physical") or {}
    if frac is None:
        return "-"
    if frac < COMM_MATTERS:
        return "comm"
    return "compute" if pb.get("free_transfers_ms", 0) >= COMPUTE_BOUND * pb.get("bound_ms", 1) else "between"


def choose(points: Sequence[dict[str, Any]], predict: Callable[[dict[str, Any]], tuple[dict, dict, float]],
           chosen: Sequence[str], title: str) -> str:
    """A Markdown table of the candidates: the baseline's and the method's predicted time, physical bound and
    fraction of it, the point's kind and wall time, and whether it is in the grid."""
    head = ["point (Mbit/s)", "baseline ms", "baseline physical bound ms (binding)", "baseline of physical",
            "method ms", "method of physical", "kind", "point wall min", "in the grid"]
    lines = [f"#### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        base, meth, wall = predict(p)
        pb = base.get("physical") or {}
        lines.append("| " + " | ".join([
            p["label"], f"{base['ms_per_iter']:.0f}", f"{pb.get('bound_ms', 0):.0f} ({pb.get('binding', '-')})",
            _pct(base.get("physical_fraction")), f"{meth['ms_per_iter']:.0f}", _pct(meth.get("physical_fraction")),
            classify(base), f"{wall / 60:.1f}", "yes" if p["text"] in chosen else ""]) + " |")
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"
