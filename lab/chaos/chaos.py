#!/usr/bin/env python3
"""Fault-injection runner: injects each fault into real multi-process runs and prints ONE table.

    python -m lab.chaos.chaos                       # every fault, 1 trial each
    python -m lab.chaos.chaos --trials 3 --json docs/results/reliability.json
    python -m lab.chaos.chaos --quick --only nan-grad,corrupt-shard

Faults come from ``lab/chaos/chaos_data.py`` (numerics, storage, checkpoints, data, arguments) and
``lab/chaos/chaos_ranks.py`` (killed, stopped and missing ranks, preemption, a NIC going down). Each is a
``(name, fn)`` with ``fn(workdir, quick) -> {"fault", "detected", "how", "detect_s", "recovered", "steps_lost",
"data_lost"}`` running ONE trial in a fresh temp dir (removed afterwards). A trial that raises counts as not
detected, with the exception as its "how". The table has one row per fault: trials, how many were detected
(how, and the median seconds from the fault to the last rank's exit), recovered, steps lost, data lost.
See docs/reliability.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback


KEYS = ("fault", "detected", "how", "detect_s", "recovered", "steps_lost", "data_lost")


def all_faults() -> list[tuple[str, object]]:
    from lab.chaos.chaos_data import FAULTS as data_faults

    faults = list(data_faults)
    from lab.chaos.chaos_ranks import FAULTS as rank_faults

    faults = list(rank_faults) + faults
    return faults


def run_trial(name: str, fn, quick: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"chaos-{name}-") as workdir:
        try:
            res = fn(workdir, quick)
        except Exception as e:  # a broken trial is reported as one, never hidden
            last = traceback.format_exception_only(type(e), e)[-1].strip()
            res = {"fault": name, "detected": False, "how": f"trial failed: {last}", "detect_s": None,
                   "recovered": None, "steps_lost": None, "data_lost": "unknown"}
    missing = [k for k in KEYS if k not in res]
    if missing:
        raise ValueError(f"fault {name}: the trial returned no {', '.join(missing)} (contract: {', '.join(KEYS)})")
    return {k: res[k] for k in KEYS}


def summarise(name: str, trials: list[dict]) -> dict:
    """One row: counts over the trials, the median detection time, the first trial's how and data lost."""
    det = [t for t in trials if t["detected"]]
    secs = [t["detect_s"] for t in det if t["detect_s"] is not None]
    rec = [t["recovered"] for t in trials if t["recovered"] is not None]
    lost = [t["steps_lost"] for t in trials if t["steps_lost"] is not None]
    how = (det or trials)[0]["how"]
    return {"fault": name, "trials": len(trials), "detected": len(det), "how": how,
            "detect_s": round(statistics.median(secs), 2) if secs else None,
            "recovered": f"{sum(bool(r) for r in rec)}/{len(rec)}" if rec else "n/a",
            "steps_lost": max(lost) if lost else None, "data_lost": trials[0]["data_lost"]}


def table(rows: list[dict], width: int = 100) -> str:
    head = ["fault", "trials", "detected", "detect s", "recovered", "steps lost", "how", "data lost"]
    body = [[r["fault"], str(r["trials"]), f"{r['detected']}/{r['trials']}",
             "-" if r["detect_s"] is None else f"{r['detect_s']:.2f}", r["recovered"],
             "-" if r["steps_lost"] is None else str(r["steps_lost"]),
             _cut(r["how"], width), _cut(str(r["data_lost"]), 40)] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep] + [line(b) for b in body])


def _cut(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 1] + "…"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="inject faults into real multi-process runs; one table of results")
    ap.add_argument("--trials", type=int, default=1, help="trials per fault (default 1)")
    ap.add_argument("--quick", action="store_true", help="smaller runs (fewer iterations and fuzz examples)")
    ap.add_argument("--only", default=None, help="comma-separated fault names (default: all)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every trial and the table rows here")
    ap.add_argument("--list", action="store_true", help="print the fault names and exit")
    args = ap.parse_args(argv)
    faults = all_faults()
    if args.list:
        print("\n".join(n for n, _ in faults))
        return 0
    if args.trials < 1:
        ap.error(f"--trials must be at least 1, got {args.trials}")
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in dict(faults)]
        if unknown:
            ap.error(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(n for n, _ in faults)}")
        faults = [(n, fn) for n, fn in faults if n in wanted]
    rows, trials_out = [], {}
    t_start = time.time()
    for i, (name, fn) in enumerate(faults, 1):
        trials = []
        for k in range(args.trials):
            t0 = time.time()
            print(f"[chaos] {i}/{len(faults)} {name}: trial {k + 1}/{args.trials} ...", file=sys.stderr, flush=True)
            res = run_trial(name, fn, args.quick)
            trials.append(res)
            print(f"[chaos] {i}/{len(faults)} {name}: trial {k + 1}/{args.trials} "
                  f"{'detected' if res['detected'] else 'NOT detected'}"
                  f"{'' if res['recovered'] is None else ', recovered' if res['recovered'] else ', not recovered'} "
                  f"({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        trials_out[name] = trials
        rows.append(summarise(name, trials))
    print(table(rows))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"command": "python -m lab.chaos.chaos " + " ".join(argv if argv is not None else sys.argv[1:]),
                       "quick": args.quick, "trials_per_fault": args.trials,
                       "wall_s": round(time.time() - t_start, 1), "rows": rows, "trials": trials_out}, f, indent=1)
            f.write("\n")
    # exit 1 when a fault went undetected (a trial skipped for want of root, "skipped: ...", does not count)
    missed = [t for ts in trials_out.values() for t in ts if not t["detected"] and not t["how"].startswith("skipped")]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
