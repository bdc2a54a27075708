#!/usr/bin/env python
"""The summary that opens docs/benchmarks.md (and the README's "Measured" section), computed from the JSON.

    python -m lab.bench.summary            # print the table
    python -m lab.bench.summary --write    # rewrite the table between the markers in docs/benchmarks.md and README.md
    python -m lab.bench.summary --check    # exit 1 when either file's table differs from the JSON's

One row per comparison: what is compared, the measured range, the conditions, and whether the target the
issue set holds. Every number is computed here from ``docs/results/*.json`` with the same rules the
benchmarks' own reports use (`peers_report.verdict`, `pipeline_grid.target_verdict` / `physical_verdict`),
so the summary cannot drift from the tables below it. Nothing here runs a benchmark.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

from lab.bench import peers_report, pipeline_grid, transfer_report

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
BEGIN = "<!-- summary: python -m lab.bench.summary --write redraws this table from docs/results/*.json -->"
END = "<!-- /summary -->"
FILES = ("docs/benchmarks.md", "README.md")


class Row(NamedTuple):
    comparison: str
    measured: str
    conditions: str
    target: str


def _load(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def _range(values: list[float], fmt: str = ".2f", unit: str = "×") -> str:
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    if lo == hi:
        return f"{lo}{unit}"
    return f"{lo.replace('-', '−')} to {hi}{unit}" if min(values) < 0 else f"{lo}–{hi}{unit}"


def _pct_range(values: list[float]) -> str:
    return _range([100 * v for v in values], ".0f", " %")


def _rates(values: list[float]) -> str:
    return f"{min(values):g}–{max(values):g} Mbit/s"


def peers_rows() -> list[Row]:
    """megareshard's best schedule against torch.distributed.pipelining's best, per (rate, tp) point."""
    grid = _load("peers_pp4.json")
    points = [p for p in grid["points"] if p["status"] == "complete"]
    comm, other = [], []
    for p in points:
        sm = p["run"]["summary"]
        (comm if sm["baseline_physical_fraction"] < peers_report.COMM_MATTERS_BELOW else other).append(p)

    def where(ps: list[dict]) -> str:
        rates = {tp: ", ".join(format(p["rate_mbit"], "g") for p in ps if p["tp"] == tp) for tp in {p["tp"] for p in ps}}
        return "; ".join(f"tp {tp} at {rates[tp]} Mbit/s" for tp in sorted(rates))

    def met(ps: list[dict]) -> int:
        return sum(peers_report.verdict(p["run"]["summary"]).startswith("met") for p in ps)

    setup = "emulated cluster, 4 hosts, pp 4, CPU/gloo, compute paced alike for both sides"
    rows = []
    for ps, need, label in ((comm, peers_report.TARGET, "where communication matters (baseline < "
                             f"{100 * peers_report.COMM_MATTERS_BELOW:.0f} % of its physical bound)"),
                            (other, 1.0, "elsewhere")):
        ratios = [p["run"]["summary"]["best_ratio"] for p in ps]
        n = met(ps)
        rows.append(Row(
            f"megareshard's best schedule vs torch.distributed.pipelining's best, {label}: speedup",
            _range(ratios), f"{where(ps)}; {setup}",
            f"≥ {need:.1f}×: {'**holds**' if n == len(ps) else '**missed**'} ({n} of {len(ps)} points)"))
    return rows


def pipeline_rows() -> list[Row]:
    """The full method (eager-1F1B, broadcast, delayed W) against the Megatron-style 1f1b+allgather."""
    rows = []
    for name, model in (("pipeline_grid_gpt.json", "GPT"), ("pipeline_grid_utransformer.json", "U-Transformer")):
        grid = _load(name)
        points = [p for p in grid["points"] if p["status"] == "complete"]
        method = [next(r for r in p["records"] if r["config"] == grid["method"]) for p in points]
        speed = [r["speedup_vs_baseline"] for r in method]
        _, trows = pipeline_grid.target_verdict(grid)
        applicable = [r for r in trows if r["status"] != "n/a"]
        gap_met = sum(r["status"] == "met" for r in applicable)
        _, prows = pipeline_grid.physical_verdict(grid)
        phys_met = sum(r["status"] == "met" for r in prows)
        t = grid.get("target") or {}
        closure = t.get("gap_closure_at_least", pipeline_grid.CLOSURE)
        physical = t.get("method_physical_at_least", pipeline_grid.PHYSICAL)
        rows.append(Row(
            f"{grid['method']} vs Megatron-style {grid['baseline']}, {model}: speedup",
            _range(speed),
            f"emulated cluster, 4 hosts × 2 ranks, tp 2, pp 4, {_rates([p['rate_mbit'] for p in points])}, "
            f"{len(points)} points, paced compute",
            f"gap closure ≥ {100 * closure:.0f} % where the baseline is below {100 * pipeline_grid.BELOW:.0f} % of its "
            "signal bound: "
            + ("**holds**" if gap_met == len(applicable) else "**missed**")
            + f" ({gap_met} of {len(applicable)} points; {_pct_range([r['gap_closure'] for r in applicable])}); "
            f"≥ {100 * physical:.0f} % of its physical bound: " + ("**holds**" if phys_met == len(prows) else "**missed**")
            + f" ({phys_met} of {len(prows)}; {_pct_range([r['fraction'] for r in prows])})"))
    return rows


def _broadcast(records: list[dict], order: str | None = None) -> list[dict]:
    return [r for r in records if r["strategy"] == "broadcast" and r["scheduler"] == "auto" and not r["simulated"]
            and (order is None or r["order"] == order)]


def _ratios(records: list[dict]) -> list[float]:
    return [r["ratio_to_bound"] for r in records]


def _holds(records: list[dict], limit: float, where=None) -> str:
    over = [r for r in records if r["ratio_to_bound"] > limit]
    out = f"≤ {limit:.2f}×: " + ("**holds**" if not over else f"**missed** ({len(records) - len(over)} of {len(records)}")
    if over and where and len(over) <= 2:
        out += "; over: " + ", ".join(f"{where(r)} {r['ratio_to_bound']:.2f}×" for r in over)
    return out + (")" if over else "")


def _case_number(case: str) -> int:
    return int(case.removeprefix("case"))


def resharding_rows() -> list[Row]:
    """Broadcast resharding (scheduler auto) against the NIC lower bound: time over the bound."""
    paper = _broadcast(_load("resharding_paper.json"))
    o2m = _broadcast(_load("resharding_o2m_hosts.json"))
    rates = {"500 Mbit/s": "resharding_4hosts_500mbit.json", "1 Gbit/s": "resharding_4hosts_1gbit.json"}
    four = [r for name in rates.values() for r in _broadcast(_load(name))]
    cases = sorted({r["case"] for r in paper}, key=_case_number)
    four_cases = sorted({r["case"] for r in four}, key=_case_number)
    orders = sorted({r["order"] for r in four})
    hosts = lambda r: f"{r['case'].rsplit('->', 1)[-1].split('x')[0]} hosts, order {r['order']}"  # noqa: E731
    return [
        Row("cross-mesh resharding, broadcast (scheduler auto) vs the NIC lower bound: time / bound",
            _range(_ratios(paper)), f"the paper's cases {_case_number(cases[0])}–{_case_number(cases[-1])} at 1/64 "
            "scale, 5 hosts × 2 ranks, 1 Gbit/s emulated NICs, both execution orders", _holds(paper, 1.25)),
        Row("1 → M replication, broadcast (auto) vs the NIC lower bound: time / bound", _range(_ratios(o2m)),
            "receivers on 1–4 hosts × 2 devices, 1 Gbit/s, both orders", _holds(o2m, 1.15, hosts)),
        Row("broadcast (auto) vs the NIC lower bound on the 4-host cluster: time / bound", _range(_ratios(four)),
            f"cases {', '.join(str(_case_number(c)) for c in four_cases)}; 4 hosts × 2 ranks at "
            f"{' and '.join(rates)}, order {', '.join(orders)}", _holds(four, 1.15)),
    ]


def gpu_rows() -> list[Row]:
    """The fast path against Hugging Face transformers + torch.compile on one GPU."""
    runs = [_load("gpu_h200_fast_path.json"), _load("gpu_h200_fast_path_rerun.json")]
    fast = [p for run in runs for p in run["speed"]["points"] if p["variant"] == "megareshard-fast"]
    ratios = [p["vs_hf_compile"] for p in fast]
    n = sum(r >= 1.0 for r in ratios)
    worst = min(fast, key=lambda p: p["vs_hf_compile"])
    models = list(dict.fromkeys(p["model"] for p in fast))
    return [Row("megareshard's fast path vs transformers + torch.compile: tokens/s ratio", _range(ratios, ".3f"),
                f"one {runs[0]['ceilings']['device']}, bf16, {', '.join(models)}, {len(runs)} runs",
                "≥ 1.0× at every point: " + ("**holds**" if n == len(ratios) else
                                             f"**missed** ({n} of {len(ratios)}; lowest {worst['model']} "
                                             f"{worst['vs_hf_compile']:.3f}×)"))]


def issue53_rows() -> list[Row]:
    """Issue 53 on one GPU: pretrain_gpt.py as a user launches it against the lean single-file peer, MFU, and the
    same command's determinism (one grid run in two launches on one machine, gpu_h200_issue53*.json)."""
    first, grid = _load("gpu_h200_issue53.json"), _load("gpu_h200_issue53_grid.json")
    points = [p for run in (first, grid) for p in run["speed"]["points"]
              if p["variant"] == "megareshard-cli" and p.get("status") == "ok"]
    targets = first["targets"]
    n = sum(p["vs_lean"] >= targets["vs_lean"][p["model"]] for p in points)
    worst = min(points, key=lambda p: p["vs_lean"])
    mfu = [(p["model"], p["mfu_vs_peak"], targets["mfu_vs_peak"][p["model"]]) for p in points
           if p["model"] in targets["mfu_vs_peak"]]
    short = [(m, v) for m, v, t in mfu if v < t]
    conditions = (f"one {first['ceilings']['device']}, bf16, sequence 2048, pretrain_gpt.py's logged tokens/s, "
                  f"{', '.join(p['model'] for p in points)}, 1 run in 2 launches")
    d = first["determinism"]
    det = d["deterministic_mode"]
    both = det["same_command_bitwise_equal"] and det["resume_bitwise_equal"]
    diff = d["same_command_first_difference"]
    default = ("bitwise equal" if d["same_command_bitwise_equal"] and d["resume_bitwise_equal"] else
               f"differ from iteration {diff['iteration']} (gradient norm {diff['a'][1]:.6f} vs {diff['b'][1]:.6f})"
               if diff else "resume differs")
    return [
        Row("megareshard (pretrain_gpt.py as launched) vs a lean single-file peer under whole-model torch.compile: "
            "tokens/s ratio", _range([p["vs_lean"] for p in points], ".3f"), conditions,
            "≥ 1.0× at every point: " + ("**holds**" if n == len(points) else
                                         f"**missed** ({n} of {len(points)}; lowest {worst['model']} "
                                         f"{worst['vs_lean']:.3f}×)")),
        Row("MFU against the datasheet's 989 TFLOP/s", ", ".join(f"{m} {100 * v:.1f} %" for m, v, _ in mfu),
            conditions, ", ".join(f"≥ {100 * t:.0f} % at {m}" for m, _, t in mfu) + ": "
            + ("**holds**" if not short else "**missed** (" + ", ".join(f"{m} {100 * v:.1f} %" for m, v in short)
               + ")")),
        Row("the same command twice, and saved at 10 + resumed vs uninterrupted: bitwise",
            f"--deterministic-mode: {'bitwise equal, both' if both else 'differ'}; default kernels: {default}",
            f"GPT 4 layers, h 512, seq 512, bf16, dropout 0.1, torch.compile on, {d['iterations']} iterations, "
            f"{first['ceilings']['device']}",
            "bitwise under --deterministic-mode: " + ("**holds**" if both else "**missed**")),
    ]


def zero_rows() -> list[Row]:
    """ZeRO step time against DeepSpeed's, and ZeRO 3's memory against 1/dp."""
    t = _load("bench_memory_zero3_time.json")["time"]
    r = t["ratios"]
    pairs = [("ZeRO 2", r["ours_zero2_over_deepspeed_zero2"]),
             ("ZeRO 3", r["ours_zero3_over_deepspeed_zero3_all_sharded"])]
    mem = _load("bench_memory_zero3_memory.json")["memory"]["rows"]
    zero3 = [row for row in mem if row["zero"] == 3]
    dev = max(abs(row["static_over_zero0"] * row["dp"] - 1) for row in zero3)
    dps = sorted({row["dp"] for row in zero3})
    return [
        Row("ZeRO 2 and 3 vs DeepSpeed's ZeRO 2 and 3: our step time / theirs",
            ", ".join(f"{name} {v:.2f}×" for name, v in pairs),
            f"GPT {t['config']['num_layers']} layers, h {t['config']['hidden_size']}, dp {t['dp']}, CPU/gloo, "
            "every variant in one launch",
            "≤ 1.0×: " + ("**holds**" if all(v <= 1.0 for _, v in pairs) else "**missed**")),
        Row("ZeRO 3's parameter + gradient + optimizer bytes per rank vs 1/dp of ZeRO 0's",
            f"within {100 * dev:.1g} %" if dev > 0 else "exact",
            f"dp {', '.join(map(str, dps))}, GPT 8 layers, h 384, CPU/gloo",
            "within 10 %: " + ("**holds**" if dev <= 0.10 else "**missed**")),
    ]


def weight_transfer_rows() -> list[Row]:
    """Live weight transfer against the network bound and the methods users would pick instead (issue #50)."""
    doc = _load("weight_transfer_1gbit.json")
    vs = transfer_report.verdicts(doc)
    tps = {sh: ", ".join("tp %d" % r["tp"] for r in e["replicas"]) for sh, e in doc["shapes"].items()}
    shapes = "; ".join(f"shape {sh}: {t}" for sh, t in tps.items())
    cond = (f"{doc['model']['bytes'] / 2**20:.0f} MiB fp32 GPT, trainer tp 2 · pp 2 on 2 hosts, generator replicas "
            f"on 2 more ({shapes}), emulated {doc['nic_gbps_nominal']:g} Gbit/s NICs, CPU/gloo")

    def row(target: str, what: str, limit: str) -> Row:
        pts = [v for v in vs if v["target"] == target]
        held = sum(v["met"] for v in pts)
        verdict = "**holds**" if held == len(pts) else f"**missed** ({held} of {len(pts)} shapes)"
        return Row(what, ", ".join(f"{v['shape']} {v['value']:.2f}×" for v in pts), cond, f"{limit}: {verdict}")

    return [row("planned / lower bound", "live weight transfer, planned: time / network lower bound", "≤ 1.2×"),
            row("per_param / planned", "live weight transfer vs per-parameter sends: speedup", "≥ 3×"),
            row("round_robin / planned", "live weight transfer vs round-robin point-to-point (Megatron-Core's "
                "refit plan): speedup", "≥ 1.5×"),
            row("dcp / planned", "live weight transfer vs DCP save + copy + load: speedup", "> 1×")]


def rows() -> list[Row]:
    return (peers_rows() + pipeline_rows() + resharding_rows() + weight_transfer_rows() + gpu_rows() + issue53_rows()
            + zero_rows())


def markdown(rs: list[Row] | None = None) -> str:
    rs = rows() if rs is None else rs
    out = ["| comparison | measured | conditions | target |", "|---|---|---|---|"]
    out += [f"| {r.comparison} | {r.measured} | {r.conditions} | {r.target} |" for r in rs]
    return "\n".join(out)


def block(table: str | None = None) -> str:
    return f"{BEGIN}\n{markdown() if table is None else table}\n{END}"


def extract(text: str) -> str | None:
    """The table between the markers, or None when the file has none."""
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def replace(text: str, table: str) -> str:
    head, rest = text.split(BEGIN, 1)
    return head + block(table) + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="rewrite the table in " + " and ".join(FILES))
    g.add_argument("--check", action="store_true", help="exit 1 when a file's table differs from the JSON's")
    a = p.parse_args(argv)
    table = markdown()
    if not (a.write or a.check):
        print(table)
        return 0
    bad = 0
    for name in FILES:
        path = ROOT / name
        text = path.read_text()
        have = extract(text)
        if have is None:
            print(f"{name}: no summary markers ({BEGIN!r} … {END!r})", file=sys.stderr)
            bad += 1
        elif have != table:
            if a.write:
                path.write_text(replace(text, table))
                print(f"{name}: summary rewritten")
            else:
                print(f"{name}: summary differs from the JSON (python -m lab.bench.summary --write)", file=sys.stderr)
                bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
