"""Where the time of a training step goes, from a torch.profiler chrome trace (megareshard's ``pretrain_gpt.py
--profile --profile-step-start S --profile-step-end E --tensorboard-dir DIR`` writes ``DIR/profile_rank0.json``).

Reads the trace's complete ("X") events: GPU kernels, copies and memsets; CUDA runtime/driver calls; host ops and
annotations. Computes, for the profiled window and per iteration: the GPU's busy time (the union over its streams)
and its idle gaps (the largest explained: the host's top-level ops then, any sync, the host op that launched the
kernel ending the gap), kernel time by category (CATEGORIES below), launches, host synchronisations (blocking CUDA
calls, by the host op they sit under), scalar reads (``aten::_local_scalar_dense``: .item(), bool(t); a sync when the
tensor is on the GPU; counted on CPU traces too), and the optimizer step and the loss (REGIONS: host ops and the GPU
work launched inside them, else kernel names only). Iterations: ``--iterations``, else the ``ProfilerStep#`` marks,
else the ``Optimizer.step#`` annotations torch.optim records (megareshard does not call ``prof.step()``), else 1.
A CPU-only trace gives ``gpu.present: false`` and the host side. Draws one iteration's timeline over bars per
category.

    python -m lab.bench.gpu_profile DIR/profile_rank0.json --iterations 2 --json prof.json --png prof.png
"""
from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

# kernel category: substrings of the lower-cased kernel name; the first row that matches wins (memcpy and memset
# events are "copy" by their trace category)
CATEGORIES = (
    ("nccl", ("nccl",)),
    ("optimizer", ("multi_tensor_apply", "fused_adam", "_fused_adamw", "foreach", "adam")),
    ("attention", ("flash", "fmha", "cudnn", "efficient_attention", "sdpa", "attention")),
    ("loss", ("cross_entropy", "nll_loss", "log_softmax", "logsoftmax", "nllloss")),
    ("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")),
    ("triton", ("triton_",)),
    ("copy", ("memcpy", "memset", "copy_kernel", "fillfunctor")),
)
OTHER = "other"
COLORS = {"gemm": "tab:blue", "attention": "tab:purple", "triton": "tab:cyan", "optimizer": "tab:green",
          "loss": "tab:orange", "copy": "tab:brown", "nccl": "tab:pink", OTHER: "tab:gray"}
PHASE_COLORS = {"optimizer": "tab:green", "loss": "tab:orange", "backward": "#9db4d6", "forward & other": "#bbbbbb"}
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"}  # older Kineto: "Kernel", "Memcpy"
RUNTIME_CATS = {"cuda_runtime", "cuda_driver", "runtime", "driver"}
HOST_CATS = {"cpu_op", "user_annotation", "operator"}
LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
            "cuGraphLaunch", "cudaLaunchCooperativeKernel"}
SYNCS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
         "cuCtxSynchronize", "cuEventSynchronize", "cudaMemcpy", "cuMemcpyDtoH"}  # + cudaMemcpyAsync to pageable
ITERATION_MARKS = ("ProfilerStep#", "Optimizer.step#")  # host annotations that end an iteration, the first found
SCALAR_READS = ("aten::_local_scalar_dense",)  # under aten::item / aten::is_nonzero: the copy to the host
REGIONS = (  # host ops (substrings of the name) whose span, and the GPU work launched in it, is the region's
    ("optimizer step", ("Optimizer.step#",)),
    ("loss", ("VocabParallelCE", "cross_entropy", "nll_loss", "log_softmax", "NllLoss", "LogSoftmax")),
)


def category(name: str, cat: str = "kernel") -> str:
    if "memcpy" in cat.lower() or "memset" in cat.lower():
        return "copy"
    low = name.lower()
    return next((c for c, keys in CATEGORIES if any(k in low for k in keys)), OTHER)


def _us(ns: int | float) -> float:
    return round(ns / 1000, 3)


def _merge(spans):
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _path(ev: dict) -> str:
    names = [p["name"] for p in ev["parents"]]
    if not names:
        return "(no host op)"
    return " > ".join(names) if len(names) <= 2 else f"{names[0]} > ... > {names[-1]}"


def _tally(evs, key) -> dict:
    """key -> [count, nanoseconds], the largest time first."""
    out: dict = defaultdict(lambda: [0, 0])
    for v in evs:
        out[key(v)][0] += 1
        out[key(v)][1] += v["t1"] - v["t0"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1][1]))


def summarize(trace, iterations: int | None = None, top_gaps: int = 10) -> dict[str, Any]:
    """The summary of a chrome trace (a path or its parsed dict); times in microseconds."""
    path, doc = ("(in memory)", trace) if isinstance(trace, dict) else (str(trace), json.loads(Path(trace).read_text()))
    host, rt, gpu = [], [], []
    for e in doc.get("traceEvents", []):
        cat = str(e.get("cat", "")).lower()
        if e.get("ph") != "X" or "dur" not in e or cat not in GPU_CATS | RUNTIME_CATS | HOST_CATS:
            continue
        t0 = round(float(e["ts"]) * 1000)  # integer nanoseconds: sums are exact
        ev = {"name": str(e.get("name", "")), "cat": cat, "t0": t0, "t1": t0 + round(float(e["dur"]) * 1000),
              "thread": (e.get("pid"), e.get("tid")), "args": e.get("args") or {}, "parents": [], "prev": None}
        (gpu if cat in GPU_CATS else rt if cat in RUNTIME_CATS else host).append(ev)
    threads = defaultdict(list)  # the host ops enclosing each host op and runtime call, and the one before it
    for ev in host + rt:
        threads[ev["thread"]].append(ev)
    for evs in threads.values():
        stack: list[dict] = []
        last: dict = {}
        for ev in sorted(evs, key=lambda v: (v["t0"], v["t0"] - v["t1"], v["cat"] in RUNTIME_CATS)):
            while stack and stack[-1]["t1"] <= ev["t0"]:
                stack.pop()
            ev["parents"] = list(stack)
            level = id(stack[-1]) if stack else None
            ev["prev"], last[level] = last.get(level), ev
            if ev["cat"] in HOST_CATS:
                stack.append(ev)
    by_corr = {ev["args"]["correlation"]: ev for ev in rt if "correlation" in ev["args"]}
    for ev in gpu:
        ev["launch"] = by_corr.get(ev["args"].get("correlation"))
        ev["category"] = category(ev["name"], ev["cat"])
    copies = {v["args"].get("correlation"): v["name"] for v in gpu if v["cat"] != "kernel"}
    blocking = [v for v in rt if _blocks(v, copies)]
    allev = host + rt + gpu
    w0, w1 = (min(v["t0"] for v in allev), max(v["t1"] for v in allev)) if allev else (0, 0)
    marks = next(((k, sorted(v["t1"] for v in host if v["name"].startswith(k))) for k in ITERATION_MARKS
                  if any(v["name"].startswith(k) for v in host)), ("", []))
    n = iterations or len(marks[1]) or 1
    per = (lambda x: _us(x / n))
    s: dict[str, Any] = {
        "trace": path, "iterations": n,
        "iterations_from": "argument" if iterations else f"{marks[0]} annotations" if marks[0] else "assumed 1",
        "window_us": _us(w1 - w0), "per_iteration_us": per(w1 - w0)}
    busy = _merge([(v["t0"], v["t1"]) for v in gpu])
    s["gpu"] = _gpu(gpu, host, blocking, busy, w0, w1, n, top_gaps) if gpu else {"present": False, "note": (
        "no GPU activity (kernel, memcpy or memset events) in this trace: a CPU run, or a profiler without "
        "ProfilerActivity.CUDA")}
    launches = [v for v in rt if v["name"] in LAUNCHES]
    s["launches"] = {"count": len(launches), "per_iteration": len(launches) / n,
                     "host_us": _us(sum(v["t1"] - v["t0"] for v in launches)),
                     "by_name": {k: c for k, (c, _) in _tally(launches, lambda v: v["name"]).items()}}
    s["syncs"] = _grouped(blocking, n, "blocking CUDA calls: the host waits for the GPU")
    s["scalar_reads"] = _grouped([v for v in host if v["name"] in SCALAR_READS], n, (
        "aten::_local_scalar_dense (.item(), bool(t)): a host synchronisation when the tensor is on the GPU (the "
        "trace does not say where it is: AdamW's step counts, e.g., live on the CPU)"))
    s["regions"] = {name: _region(keys, host, gpu, name, n) for name, keys in REGIONS}
    top = _tally([v for v in host if not v["parents"]], lambda v: v["name"])
    s["host"] = {"threads": len(threads), "ops": len(host), "runtime_calls": len(rt),
                 "top_level_ops": [{"op": k, "count": c, "us": _us(t), "per_iteration_us": per(t)}
                                   for k, (c, t) in list(top.items())[:12]],
                 "phases_per_iteration_us": {k: per(t) for k, (_, t) in _tally(
                     [v for v in host if not v["parents"]], lambda v: _phase(v["name"])).items()}}
    ends = marks[1]
    r0, r1 = (ends[-2], ends[-1]) if len(ends) >= 2 else (w0, w1)
    r1 = max([r1] + [v["t1"] for v in gpu if v.get("launch") and r0 <= v["launch"]["t0"] < r1])
    s["timeline"] = _timeline(threads, blocking, gpu, busy, r0, r1, marks[0] if len(ends) >= 2 else "", w0)
    return s


def _gpu(gpu, host, blocking, busy, w0, w1, n, top_gaps) -> dict:
    """Busy time (the union over streams), idle gaps (the largest explained), time by kernel category."""
    per = (lambda x: _us(x / n))
    busy_ns = sum(b - a for a, b in busy)
    gaps = [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)]
    starts, ends = {v["t0"]: v for v in gpu}, {v["t1"]: v for v in gpu}
    tops = [v for v in host if not v["parents"]]
    largest = []
    for a, b in sorted(gaps, key=lambda ab: ab[0] - ab[1])[:top_gaps]:
        during = defaultdict(int)
        for v in tops:
            if v["t0"] < b and v["t1"] > a:
                during[v["name"]] += min(b, v["t1"]) - max(a, v["t0"])
        nxt, launch = starts[b], starts[b].get("launch")
        largest.append({
            "at_us": _us(a - w0), "gap_us": _us(b - a), "before": ends[a]["name"], "after": nxt["name"],
            "after_launched_under": _path(launch) if launch else None,
            "after_launched_at_us": _us(launch["t0"] - a) if launch else None,  # from the gap's start
            "host_during": [{"op": k, "us": _us(t)} for k, t in sorted(during.items(), key=lambda kv: -kv[1])[:3]],
            "syncs_during": sorted({f"{v['name']} under {_path(v)}" for v in blocking if v["t0"] < b and v["t1"] > a})})
    streams = defaultdict(list)
    for v in gpu:
        streams[(v["args"].get("device", v["thread"][0]), v["args"].get("stream", v["thread"][1]))].append(v)
    delays = [v["t0"] - v["launch"]["t0"] for v in gpu if v.get("launch")]
    idle = sum(b - a for a, b in gaps)
    return {
        "present": True,
        "streams": [{"device": d, "stream": st, "events": len(vs),
                     "busy_us": _us(sum(b - a for a, b in _merge([(v["t0"], v["t1"]) for v in vs])))}
                    for (d, st), vs in sorted(streams.items(), key=lambda kv: str(kv[0]))],
        "span_us": _us(busy[-1][1] - busy[0][0]), "busy_us": _us(busy_ns), "busy_per_iteration_us": per(busy_ns),
        "busy_fraction_of_span": round(busy_ns / max(busy[-1][1] - busy[0][0], 1), 4),
        "idle": {"inside_us": _us(idle), "count": len(gaps), "inside_per_iteration_us": per(idle),
                 "count_per_iteration": len(gaps) / n, "before_first_us": _us(busy[0][0] - w0),
                 "after_last_us": _us(w1 - busy[-1][1]), "largest": largest},
        "categories": {k: {"count": c, "time_us": _us(t), "per_iteration_us": per(t)}
                       for k, (c, t) in _tally(gpu, lambda v: v["category"]).items()},
        "launch_to_start_median_us": _us(statistics.median(delays)) if delays else None}


def _blocks(v: dict, copies: dict) -> bool:
    if v["name"] in SYNCS:
        return True
    copy = copies.get(v["args"].get("correlation"))  # cudaMemcpyAsync to pageable memory: done when it returns
    return v["name"].startswith("cudaMemcpyAsync") and copy is not None and "DtoH" in copy and "Pageable" in copy


def _grouped(evs: list[dict], n: int, what: str) -> dict:
    """Calls, points (a host op holding several calls is one point), time, by host op and the op before it."""
    points = {id(v["parents"][-1]) if v["parents"] else id(v) for v in evs}

    def where(v):
        outer = next((p for p in v["parents"] if p["name"] in ("aten::item", "aten::is_nonzero")), v)
        return f"{_path(v)} > {v['name']}" + (f" (after {outer['prev']['name']})" if outer["prev"] else "")
    t = sum(v["t1"] - v["t0"] for v in evs)
    return {"what": what, "calls": len(evs), "points": len(points), "points_per_iteration": len(points) / n,
            "time_us": _us(t), "per_iteration_us": _us(t / n),
            "by_op": [{"under": k, "calls": c, "us": _us(u)} for k, (c, u) in _tally(evs, where).items()]}


def _region(keys, host, gpu, name, n) -> dict:
    spans = _merge([(v["t0"], v["t1"]) for v in host if any(k in v["name"] for k in keys)])
    by_name = [v for v in gpu if v["category"] == name.split()[0]]
    t_name = sum(v["t1"] - v["t0"] for v in by_name)
    out: dict[str, Any] = {"host_ops_matching": list(keys),
                           "kernel_name_rows": {"kernels": len(by_name), "gpu_us": _us(t_name)}}
    if not spans:
        return {**out, "attributed_by": "kernel names only (no matching host op in the trace)",
                "gpu_us": _us(t_name), "per_iteration_gpu_us": _us(t_name / n)}
    starts = [a for a, _ in spans]
    inside = [v for v in gpu if v.get("launch") and (i := bisect.bisect_right(starts, v["launch"]["t0"]) - 1) >= 0
              and v["launch"]["t0"] < spans[i][1]]
    t, host_ns = sum(v["t1"] - v["t0"] for v in inside), sum(b - a for a, b in spans)
    return {**out, "attributed_by": "host ops (and the GPU work launched inside them)",
            "host_us": _us(host_ns), "per_iteration_host_us": _us(host_ns / n), "kernels": len(inside),
            "gpu_us": _us(t), "per_iteration_gpu_us": _us(t / n)}


def _phase(name: str) -> str:
    for region, keys in REGIONS:
        if any(k in name for k in keys):
            return region.split()[0]
    return "backward" if name.startswith("autograd::engine") else "forward & other"


def _timeline(threads, blocking, gpu, busy, r0, r1, mark, w0) -> dict:
    def clip(vs, label):
        return [[_us(v["t0"] - r0), _us(v["t1"] - v["t0"]), label(v)] for v in vs if v["t0"] < r1 and v["t1"] > r0]
    lanes = []
    for th in sorted(threads, key=lambda th: -sum(v["t1"] - v["t0"] for v in threads[th] if not v["parents"]))[:3]:
        evs = threads[th]
        lanes.append({"lane": "host main" if th[0] == th[1] else f"host tid {th[1]}",
                      "ops": clip([v for v in evs if not v["parents"] and v["cat"] in HOST_CATS],
                                  lambda v: _phase(v["name"])),
                      "syncs": clip([v for v in blocking if v["thread"] == th], lambda v: v["name"]),
                      "scalar_reads": clip([v for v in evs if v["name"] in SCALAR_READS], lambda v: v["name"])})
    gpu_lanes = [{"lane": f"GPU {st[0]} stream {st[1]}", "ops": clip([v for v in gpu if v["thread"] == st],
                                                             lambda v: v["category"])}
                 for st in sorted({v["thread"] for v in gpu}, key=str)]
    gaps = [[_us(busy[i][1] - r0), _us(busy[i + 1][0] - busy[i][1])] for i in range(len(busy) - 1)
            if busy[i][1] < r1 and busy[i + 1][0] > r0]
    what = f"the last iteration (host: from the end of one {mark} to the next)" if mark else "the profiled window"
    return {"what": what, "start_us": _us(r0 - w0), "length_us": _us(r1 - r0), "host": lanes, "gpu": gpu_lanes,
            "gaps": gaps}


def draw(summary_or_trace, png_path: str, iterations: int | None = None) -> None:
    """One iteration's timeline (host lanes: top-level ops by phase, syncs red, scalar reads black ticks; GPU lanes:
    kernels by category, idle gaps shaded red) over bars of the time per iteration (GPU by category, host by phase)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    s = summary_or_trace if isinstance(summary_or_trace, dict) else summarize(summary_or_trace, iterations)
    tl, ms = s["timeline"], 1e-3
    lanes = [(ln, PHASE_COLORS) for ln in tl["host"]] + [(ln, COLORS) for ln in tl["gpu"]]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(15, 2.6 + 0.6 * len(lanes)),
                                 gridspec_kw={"height_ratios": [max(len(lanes), 2), 1.5]})
    for y, (ln, cmap) in zip(range(len(lanes) - 1, -1, -1), lanes):
        bars = lambda evs, y0, h, color: ax.broken_barh(  # noqa: E731
            [(a * ms, max(d * ms, tl["length_us"] * ms / 1500)) for a, d, _ in evs], (y + y0, h), linewidth=0,
            facecolors=color if isinstance(color, str) else [color.get(c, "tab:gray") for _, _, c in evs])
        bars(ln["ops"], -0.3, 0.6, cmap)
        bars(ln.get("syncs", []), -0.45, 0.9, "red")
        bars(ln.get("scalar_reads", []), 0.3, 0.15, "black")
    ax.broken_barh([(a * ms, d * ms) for a, d in tl["gaps"]], (-0.5, len(tl["gpu"])), facecolors="red", alpha=0.15,
                   linewidth=0)
    ax.set_yticks(range(len(lanes)), [ln["lane"] for ln, _ in reversed(lanes)])
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlim(0, tl["length_us"] * ms)
    ax.set_xlabel(f"ms from the start of {tl['what']}")
    if not tl["gpu"]:
        ax.set_title(s["gpu"]["note"], fontsize=9)
    handles = [Patch(color=c, label=f"host: {k}") for k, c in PHASE_COLORS.items()] + [
        Patch(color="red", label="host sync"), Patch(color="black", label="scalar read")] + ([
            Patch(color=c, label=f"GPU: {k}") for k, c in COLORS.items()] + [
            Patch(color="red", alpha=0.15, label="GPU idle")] if tl["gpu"] else [])
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)
    n, rows = s["iterations"], []
    if s["gpu"]["present"]:
        rows.append(("GPU", [(k, c["per_iteration_us"], COLORS.get(k, "tab:gray"))
                             for k, c in s["gpu"]["categories"].items()]
                     + [("idle", s["gpu"]["idle"]["inside_per_iteration_us"], "#f3c6c6")]))
    rows.append(("host", [(k, v, PHASE_COLORS[k]) for k, v in s["host"]["phases_per_iteration_us"].items()]
                 + [("syncs", s["syncs"]["per_iteration_us"], "red")]))
    for y, (name, parts) in enumerate(rows):
        x = 0.0
        for k, v, c in parts:
            bx.barh(y, v * ms, left=x, color=c, height=0.6)
            if v > 0.05 * s["per_iteration_us"]:
                bx.text(x + v * ms / 2, y, f"{k}\n{v * ms:.2f}", ha="center", va="center", fontsize=7)
            x += v * ms
    bx.set_yticks(range(len(rows)), [r[0] for r in rows])
    bx.set_xlabel(f"ms per iteration (window / {n}; host: top-level ops, syncs counted inside them too; "
                  f"{s['syncs']['points_per_iteration']:.1f} syncs and {s['scalar_reads']['points_per_iteration']:.1f}"
                  " scalar reads per iteration)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def table(s: dict) -> str:
    n, g, ms = s["iterations"], s["gpu"], (lambda us: f"{us / 1e3:.2f} ms")
    out = [f"{s['trace']}: {n} iteration(s) ({s['iterations_from']}), {ms(s['per_iteration_us'])} per iteration"]
    if not g["present"]:
        out.append(f"GPU: {g['note']}")
    else:
        out.append(f"GPU busy {ms(g['busy_per_iteration_us'])}/iter ({100 * g['busy_fraction_of_span']:.0f}% of its "
                   f"span); {g['idle']['count_per_iteration']:.0f} idle gaps/iter, "
                   f"{ms(g['idle']['inside_per_iteration_us'])}/iter; launch to start: median "
                   f"{g['launch_to_start_median_us']} us")
        out.append("  " + ", ".join(f"{k} {ms(c['per_iteration_us'])} ({c['count'] / n:.0f})"
                                    for k, c in g["categories"].items()))
        out += [f"  gap {x['gap_us']:.0f} us before {x['after'][:60]} (launched under {x['after_launched_under']}); "
                f"host in {', '.join(h['op'] for h in x['host_during']) or '-'}" for x in g["idle"]["largest"][:5]]
    out.append("host, top-level ops: " + ", ".join(f"{k} {ms(v)}/iter"
                                                   for k, v in s["host"]["phases_per_iteration_us"].items()))
    out.append(f"launches {s['launches']['per_iteration']:.0f}/iter; syncs {s['syncs']['points_per_iteration']:.1f}"
               f"/iter ({ms(s['syncs']['per_iteration_us'])}/iter blocked); scalar reads "
               f"{s['scalar_reads']['points_per_iteration']:.1f}/iter")
    out += [f"  {k}: {r['calls'] / n:.1f}/iter, {r['us'] / n:.0f} us/iter: {r['under']}"
            for k in ("syncs", "scalar_reads") for r in s[k]["by_op"][:4]]
    out += [f"{k}: " + (f"host {ms(r['per_iteration_host_us'])}/iter, " if "host_us" in r else "")
            + f"GPU {ms(r['per_iteration_gpu_us'])}/iter ({r['attributed_by']})" for k, r in s["regions"].items()]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a chrome trace from torch.profiler (e.g. DIR/profile_rank0.json)")
    ap.add_argument("--iterations", type=int, help="iterations in the profiled window (default: optimizer steps)")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--png", help="draw the picture here")
    a = ap.parse_args(argv)
    try:
        s = summarize(a.trace, a.iterations)
    except (OSError, ValueError) as e:
        print(f"gpu_profile: {a.trace}: {e}", file=sys.stderr)
        return 2
    print(table(s))
    if a.json:  # the timeline on one line: thousands of kernels
        text = json.dumps({k: v for k, v in s.items() if k != "timeline"}, indent=1)
        with open(a.json, "w") as f:
            f.write(text[:-2] + ',\n "timeline": ' + json.dumps(s["timeline"], separators=(",", ":")) + "\n}\n")
    if a.png:
        draw(s, a.png)
        print(f"picture: {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
