"""docs/benchmarks.md and the README answer from the JSON: the summary table, numbers quoted in the prose,
and the pictures' titles and legends (issue 51). Cheap: reads docs/results/*.json and draws two small figures."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from lab.bench import summary

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
KIND_LABELS = ("F forward", "B backward", "I input-grad", "W weight-grad")
WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}


def load(name: str):
    return json.loads((RESULTS / name).read_text())


def flat(text: str) -> str:
    """Whitespace collapsed, so a quote may cross the doc's line breaks."""
    return " ".join(text.split())


@pytest.mark.parametrize("name", summary.FILES)
def test_summary_table_is_the_one_the_json_gives(name):
    text = (ROOT / name).read_text()
    have = summary.extract(text)
    assert have is not None, f"{name} has no summary table (python -m lab.bench.summary --write)"
    assert have == summary.markdown(), f"{name}'s summary differs from the JSON (python -m lab.bench.summary --write)"


def test_summary_answers_the_question_with_the_peers_verdicts():
    rows = summary.peers_rows()
    grid = load("peers_pp4.json")
    ratios = [p["run"]["summary"]["best_ratio"] for p in grid["points"] if p["status"] == "complete"]
    assert len(rows) == 2 and all("torch.distributed.pipelining" in r.comparison for r in rows)
    lows = [float(r.measured.split("–")[0].rstrip("×")) for r in rows]
    assert min(lows) == round(min(ratios), 2)
    assert "missed" in rows[0].target  # the 1.2x target where communication matters


# ------------------------------------------------------------------------------------ prose numbers
def _peers():
    return {(p["rate_mbit"], p["tp"]): p for p in load("peers_pp4.json")["points"]}


def _grid(model):
    g = load(f"pipeline_grid_{model}.json")
    return g, [{r["config"]: r for r in p["records"]} for p in g["points"]], \
        [{r["config"]: r for r in p["simulated"]} for p in g["points"]]


def _pcts(values):
    return ", ".join(f"{100 * v:.0f}" for v in values[:-1]) + f" and {100 * values[-1]:.0f} %"


def _gpu(variant, model):
    runs = [load("gpu_h200_fast_path.json"), load("gpu_h200_fast_path_rerun.json")]
    return [next(p for p in r["speed"]["points"] if p["model"] == model and p["variant"] == variant) for r in runs]


def quotes() -> list[tuple[str, str]]:
    """(what the doc must say, what the JSON gives): each quote is built from the JSON and must appear verbatim."""
    paper = load("resharding_paper.json")
    o2m = load("resharding_o2m_hosts.json")
    out = []
    gbps = paper[0]["model_nic_gbps"]
    out.append(("paper suite's calibrated goodput", f"`--calibrate-mb 32`: {1e3 * gbps:.0f} Mbit/s, {gbps:.3f} of nominal"))
    moved = [r["nic_bytes"] / 1e6 for r in paper if r["strategy"] != "signal"]
    out.append(("bytes across NICs", f"moves {min(moved):.0f}–{max(moved):.0f} MB across NICs"))
    for order in ("plan", "concurrent"):
        pm = [r["predicted_s"] / r["seconds"] for r in paper if r["order"] == order and r["strategy"] != "signal"]
        if order == "plan":
            out.append(("predictions, plan", f"{len(pm)} of {len(pm)} (pred/meas {min(pm):.2f}–{max(pm):.2f}, "
                                            f"median {statistics.median(pm):.2f})"))
    inter = [r for r in o2m if r["case"].startswith("inter")]

    def ends(strategy, order):
        s = [r["seconds"] for r in inter if r["strategy"] == strategy and r["order"] == order]
        return f"{s[0]:.2f} → {s[-1]:.2f} s"
    for order in ("plan", "concurrent"):
        out.append((f"1 -> M, {order}", f"{ends('broadcast', order)} vs {ends('sendrecv', order)}"))
    pm = [r["predicted_s"] / r["seconds"] for r in o2m]
    worst = max(abs(1 - x) for x in pm)
    out.append(("1 -> M predictions", f"within {math.ceil(100 * worst)} % of every measurement (pred/meas "
                                      f"{min(pm):.2f}–{max(pm):.2f})"))
    four = {rate: [r for r in load(f"resharding_4hosts_{rate}.json") if r["strategy"] == "broadcast"]
            for rate in ("500mbit", "1gbit")}
    rng = {k: [r["ratio_to_bound"] for r in v] for k, v in four.items()}
    out.append(("4 hosts, broadcast", f"{min(rng['500mbit']):.2f}–{max(rng['500mbit']):.2f}× of the bound at 500 "
                                      f"Mbit/s and {min(rng['1gbit']):.2f}–{max(rng['1gbit']):.2f}× at 1 Gbit/s"))
    trace = load("resharding_trace_500mbit.json")
    out.append(("traced goodput", f"calibrated goodput {1e3 * trace[0]['model_nic_gbps']:.0f} Mbit/s"))

    train = {r["layout"]: r for r in load("bench_train_quickstart.json")}
    out.append(("tp 2 collectives", f"({100 * train['tp2']['tp_comm_share']:.0f} %)"))
    out.append(("pure dp", f"pure data parallelism {train['tp1']['speedup_vs_first']:.2f}× faster"))

    runs = [load("gpu_h200_fast_path.json"), load("gpu_h200_fast_path_rerun.json")]
    out.append(("matrix product", "matrix product " + " / ".join(f"{r['ceilings']['bf16_matmul_tflops']:.0f}"
                                                                 for r in runs) + " TFLOP/s"))
    fast2 = [p["compile_s"] for p in runs[1]["speed"]["points"] if p["variant"] == "megareshard-fast"]
    fast1 = [p["compile_s"] for p in runs[0]["speed"]["points"] if p["variant"] == "megareshard-fast"]
    out.append(("compile times", f"({min(fast2):.0f}–{max(fast2):.0f} s instead of {min(fast1):.0f}–{max(fast1):.0f} s"))
    speed = [f["tokens_per_s"] / e["tokens_per_s"] for f, e in zip(_gpu("megareshard-fast", "gpt-125m"),
                                                                     _gpu("megareshard-eager", "gpt-125m"))]
    out.append(("fast over eager, 125M", f"{min(speed):.2f}–{max(speed):.2f}× faster at 125M"))
    cuda = load("gpu_h200_cuda_tests.json")["cuda_tests"]["summary"]
    out.append(("CUDA tests", f"{cuda.split()[0]} passed in {float(cuda.split(' in ')[1].split('s')[0]):.0f} s"))

    mem = {(r["dp"], r["zero"]): r for r in load("bench_memory_zero3_memory.json")["memory"]["rows"]}
    mib = lambda x: x / 2 ** 20  # noqa: E731
    z0, z3 = mem[(8, 0)], mem[(8, 3)]
    out.append(("ZeRO 3 resident set", f"falls by {mib(z0['rss_rest'] - z3['rss_rest']):.0f} MiB at dp 8 "
                                       f"({mib(z0['rss_rest']):.0f} → {mib(z3['rss_rest']):.0f} MiB"))
    runtime = [mib(r["rss_rest"] - r["params"] - r["grads"] - r["optimizer"]) for r in mem.values()]
    out.append(("runtime's share of RSS", f"leaves about {round(statistics.mean(runtime), -1):.0f} MiB of the runtime"))
    ratios = load("bench_memory_zero3_time.json")["time"]["ratios"]
    out.append(("ZeRO vs DeepSpeed", f"Ours ZeRO 2 is {ratios['ours_zero2_over_deepspeed_zero2']:.2f}× DeepSpeed's "
                                     f"ZeRO 2 ({ratios['cpu_ours_zero2_over_deepspeed_zero2']:.2f}× in CPU seconds)"))
    out.append(("ZeRO 3 vs DeepSpeed", f"Ours ZeRO 3 is {ratios['ours_zero3_over_deepspeed_zero3_all_sharded']:.2f}× "
                                       "DeepSpeed's ZeRO 3 like for like"))

    old = load("pipeline_grid_gpt_old_calibration.json")["points"]
    done = sum(p["status"] == "complete" for p in old)
    out.append(("old calibration start", f"stopped by hand after {WORDS[done]} of its {WORDS[len(old)]} points"))
    for model, name in (("gpt", "GPT"), ("utransformer", "U-Transformer")):
        g, by, sim = _grid(model)
        out.append((f"{model} physical fractions", _pcts([b[g["method"]]["physical_fraction"] for b in by])))
        out.append((f"{model} simulated fractions", f"{name} " + _pcts([s[g["method"]]["physical_fraction"]
                                                                         for s in sim]).removesuffix(" %")))
    sendrecv = [b["1f1b+sendrecv"]["speedup_vs_baseline"] for m in ("gpt", "utransformer") for b in _grid(m)[1]]
    out.append(("sendrecv vs baseline", f"is {min(sendrecv):.2f}–{max(sendrecv):.2f}× of the baseline"))
    g, by, _ = _grid("utransformer")
    worst = min(by, key=lambda b: b[g["method"]]["speedup_vs_baseline"])
    out.append(("U-Transformer 20 m 16", f"{worst[g['method']]['speedup_vs_baseline']:.2f}×** "
                                         f"({worst[g['method']]['ms_per_iter']:.0f} against "
                                         f"{worst[g['baseline']]['ms_per_iter']:.0f} ms)"))
    rerun = {r["config"]: r for r in load("ut_rounds_20mbit_m16/run.json")["records"]}
    m, b = rerun["eager-1f1b+broadcast+dw"], rerun["1f1b+allgather"]
    out.append(("U-Transformer rerun", f"{m['speedup_vs_baseline']:.2f}× ({m['ms_per_iter']:.0f} against "
                                       f"{b['ms_per_iter']:.0f} ms"))

    peers = _peers()
    tp2 = [p["wall_s"] for (rate, tp), p in peers.items() if tp == 2 and "rerun" not in p]
    out.append(("tp 2 point time", f"tp 2 points take ~{statistics.mean(tp2):.0f} s"))
    out.append(("tp 2 rerun time", f"`--points 20:tp=2 --point-timeout 600`, {peers[(20.0, 2)]['wall_s']:.0f} s"))
    tp1 = [p["run"]["summary"] for (rate, tp), p in peers.items() if tp == 1]
    need = [peers_target() / s["physical_best_ratio"] for s in tp1]
    out.append(("what 1.2x needs", f"our best at {100 * min(need):.0f}–{100 * max(need):.0f} % of its physical bound"))
    own = []
    for side in ("megareshard_best", "torch_best"):
        f = []
        for (rate, tp), p in peers.items():
            if tp == 1:
                by_name = {r["name"]: r for r in p["run"]["records"]}
                f.append(by_name[p["run"]["summary"][side]]["physical_fraction"])
        own.append(f"{100 * min(f):.0f}–{100 * max(f):.0f} %")
    out.append(("fractions at tp 1", f"our best is at {own[0]} of its physical bound and torch's best at {own[1]} of "
                                     "its own"))
    return out


def peers_target() -> float:
    from lab.bench import peers_report

    return peers_report.TARGET


def test_numbers_in_the_prose_are_the_jsons():
    doc = flat(DOC.read_text())
    missing = [f"{what}: {quote!r}" for what, quote in quotes() if flat(quote) not in doc]
    assert not missing, "docs/benchmarks.md does not say what the JSON says:\n" + "\n".join(missing)


def test_no_number_the_json_contradicts_is_left():
    doc = flat(DOC.read_text())
    for stale in ("931 Mbit/s", "246 s and 267 s", "stopped by hand after its first point",
                  "stopped by hand after one point", "0.48–1.00×", "1.29–1.39×", "432 s"):
        assert stale not in doc, stale


# ------------------------------------------------------------------------------------ pictures
def _rect_kinds(fig) -> set[str]:
    """The compute kinds a timeline figure draws, read back from its boxes' colours."""
    from matplotlib.colors import to_hex
    from matplotlib.patches import Rectangle

    from megareshard.pipeline.draw import COLORS

    by_color = {to_hex(c): k for k, c in COLORS.items()}
    return {by_color[to_hex(p.get_facecolor())] for ax in fig.axes for p in ax.patches
            if isinstance(p, Rectangle) and to_hex(p.get_facecolor()) in by_color}


@pytest.mark.parametrize("delay_wgrad", [False, True])
def test_timeline_legend_names_exactly_the_kinds_drawn(delay_wgrad, monkeypatch, tmp_path):
    pytest.importorskip("matplotlib", reason="the plots extra installs matplotlib (tools/ensure_venv.sh)")
    import matplotlib.pyplot as plt

    from megareshard.pipeline import Costs, generate, simulate
    from megareshard.pipeline.draw import draw

    tl = simulate(generate("1f1b", 2, 2, delay_wgrad=delay_wgrad), costs=Costs(comm=0.5))
    figs = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    draw([tl], tmp_path / "t.png", 0.5, "cost units")
    (fig,) = figs
    try:
        drawn = _rect_kinds(fig)
        assert drawn == ({"F", "I", "W"} if delay_wgrad else {"F", "B"})
        labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
        kinds = {label.split()[0] for label in labels if label in KIND_LABELS}
        assert kinds == drawn, f"legend {labels} against boxes drawn {sorted(drawn)}"
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:  # every panel's title inside the figure
            for text in (ax.title, ax._left_title):
                ext = text.get_window_extent(renderer)
                assert not text.get_text() or (ext.x0 >= 0 and ext.x1 <= fig.bbox.x1 + 0.5)
    finally:
        real_close(fig)


def test_plan_layout_picture_title_fits_the_figure(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib", reason="the plots extra installs matplotlib (tools/ensure_venv.sh)")
    import matplotlib.pyplot as plt

    from megareshard.planner.candidate import Candidate
    from megareshard.planner.costs import ClusterSpec
    from megareshard.planner.report import draw_layout

    # the README example's best layout: a long name on a narrow figure
    c = Candidate(tp=2, pp=8, dp=32, micro_batch=1, num_microbatches=32, schedule="eager-1f1b", delay_wgrad=True,
                  strategy="broadcast", sequence_parallel=False, recompute=False, zero=2, order="tp-dp-pp",
                  layers_per_stage=(4, 5, 5, 4, 4, 4, 4, 2),
                  stage_layouts=",".join(["tp4dp16"] + ["tp2dp32"] * 6 + ["tp4dp16"]), step_s=1.669)
    cluster = ClusterSpec(64, 8, 80.0, 989.0, 0.45, 400.0, 3600.0)
    figs = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    draw_layout(c, cluster, str(tmp_path / "layout.png"))
    assert (tmp_path / "layout.png").stat().st_size > 0
    (fig,) = figs
    try:
        title = fig.axes[0].title
        text = title.get_text()
        assert c.name.split()[0][:20] in text.replace("\n", "") and "64 hosts × 8 devices" in text.replace("\n", " ")
        ext = title.get_window_extent(fig.canvas.get_renderer())
        assert ext.x0 >= fig.bbox.x0 and ext.x1 <= fig.bbox.x1, (ext, fig.bbox)
    finally:
        real_close(fig)
