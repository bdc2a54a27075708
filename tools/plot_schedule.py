#!/usr/bin/env python
"""Draw a pipeline schedule's timeline (simulated or measured) as a PNG, paper Figure 4 style.

One row per stage (stage 0 on top), coloured F/B/I/W boxes labelled with the microbatch,
the stage's outgoing transfers as thin bars under its row. Prints makespan, bubble
fraction and peak live activations per schedule (a table, or JSON with --json). Times are
seconds for a measured trace and cost units (a forward takes --cost-f) for a simulation.

    python tools/plot_schedule.py --schedule 1f1b --stages 4 --microbatches 8 \\
        --comm 0.5 -o 1f1b.png
    python tools/plot_schedule.py --compare --schedule 1f1b eager-1f1b eager-1f1b+dw \\
        --stages 4 --microbatches 8 --comm 1 -o cmp.png
    python tools/plot_schedule.py --trace trace.json -o measured.png
    python tools/plot_schedule.py --schedule-file my_schedule.csv --comm 0.5 -o mine.png

A schedule name may end in ``+dw`` (delayed weight gradients for that one);
``--delay-wgrad`` applies it to all. A trace is the runtime's JSON list of
{stage, kind, mb, start, end} records (SEND_F/SEND_B records, with optional edge/peer,
are drawn as transfers). Matplotlib is imported only when drawing (extras: plots/test).
"""

from __future__ import annotations

from types import MappingProxyType

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megareshard.pipeline import (  # noqa: E402
    REGISTRY,
    SCHEDULES,
    Costs,
    PipelineGraph,
    Schedule,
    Timeline,
    generate,
    simulate,
    validate,
)

COLORS = MappingProxyType({"F": "#6fa8dc", "B": "#93c47d", "I": "#b6d7a8", "W": "#f6b26b"})
COMM_COLORS = MappingProxyType({"F": "#3d85c6", "B": "#38761d"})


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", nargs="+", default=["1f1b"],
                   help=f"one of {', '.join(SCHEDULES)}, optionally with +dw; several with --compare")
    p.add_argument("--delay-wgrad", action="store_true", help="split B into I + delayed W")
    p.add_argument("--stages", "-P", type=int, default=4)
    p.add_argument("--microbatches", "-m", type=int, default=8)
    p.add_argument("--comm", type=float, default=0.0, help="transfer time per edge and microbatch")
    p.add_argument("--cost-f", type=float, default=1.0)
    p.add_argument("--cost-b", type=float, default=2.0)
    p.add_argument("--cost-i", type=float, default=None, help="default: cost-b / 2")
    p.add_argument("--cost-w", type=float, default=None, help="default: cost-b - cost-i")
    p.add_argument("--rendezvous", action="store_true",
                   help="a transfer starts only once the receiver posted its receive")
    p.add_argument("--no-recv-nic", action="store_true",
                   help="leave the receiving stage's NIC out of the model (only the sender's NIC is a bottleneck)")
    p.add_argument("--skip", nargs=2, type=int, action="append", default=[], metavar=("SRC", "DST"),
                   help="add a skip edge SRC->DST (repeatable)")
    p.add_argument("--trace", type=Path, help="draw a measured trace (JSON) instead of simulating")
    p.add_argument("--schedule-file", type=Path,
                   help="simulate the schedule written in this file (--pipeline-schedule-file's forms) instead")
    p.add_argument("--compare", action="store_true", help="stack every --schedule in one figure")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.add_argument("-o", "--output", type=Path, help="PNG to write (omit: metrics only)")
    return p.parse_args(argv)


def build_timelines(args: argparse.Namespace) -> list[Timeline]:
    if args.trace is not None:
        records = json.loads(args.trace.read_text())
        return [Timeline.from_trace(records, name=args.trace.stem)]
    names = args.schedule if args.compare else args.schedule[:1]
    graph = PipelineGraph(args.stages, tuple(tuple(e) for e in args.skip))
    costs = Costs(f=args.cost_f, b=args.cost_b, i=args.cost_i, w=args.cost_w,
                  comm=args.comm, rendezvous=args.rendezvous, recv_nic=not args.no_recv_nic)
    if args.schedule_file is not None:
        sched = Schedule.load(args.schedule_file)
        validate(sched)
        sched.name = sched.name or args.schedule_file.stem
        return [simulate(sched, costs=costs)]
    out = []
    for spec in names:
        name, dw = (spec[:-3], True) if spec.endswith("+dw") else (spec, args.delay_wgrad)
        if REGISTRY[name].stages_per_mesh == 1:
            sched = generate(name, args.stages, args.microbatches, delay_wgrad=dw, graph=graph)
            out.append(simulate(sched, costs=costs))
            continue
        if args.skip:
            raise SystemExit(f"plot_schedule: --skip applies to one-stage-per-mesh schedules, not {name}")
        sched = generate(name, args.stages, args.microbatches, delay_wgrad=dw)
        V = sched.num_stages // args.stages  # a virtual stage is 1/V of a mesh's layers: 1/V of its costs
        per = {k: (None if v is None else v / V) for k, v in (("f", args.cost_f), ("b", args.cost_b),
                                                               ("i", args.cost_i), ("w", args.cost_w))}
        out.append(simulate(sched, costs=Costs(**per, comm=args.comm, rendezvous=args.rendezvous,
                                               recv_nic=not args.no_recv_nic)))
    return out


def time_unit(args: argparse.Namespace) -> str:
    """What the timeline's times count: seconds for a measured trace; for a simulation the unit of the costs
    given (a forward's time is --cost-f of them)."""
    if args.trace is not None:
        return "s"
    return f"cost units, F = {args.cost_f:g}"


def format_table(timelines: Sequence[Timeline], unit: str = "cost units") -> str:
    rows = [("schedule", f"makespan ({unit})", "bubble", "peak activations per stage")]
    rows += [(t.name, f"{t.makespan:g}", f"{t.bubble_fraction:.3f}",
              " ".join(map(str, t.peak_activations))) for t in timelines]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def title(tl: Timeline, unit: str, width_chars: int) -> str:
    """The panel's title, wrapped to ``width_chars`` (the figure's width at the title's font size)."""
    import textwrap

    text = (f"{tl.name}: makespan {tl.makespan:.4g} {unit.split(',')[0]}, bubble {tl.bubble_fraction:.1%}, peak "
            f"activations per stage {' '.join(map(str, tl.peak_activations))}")
    return "\n".join(textwrap.wrap(text, max(width_chars, 20)))


def draw(timelines: Sequence[Timeline], path: Path, comm_cost: float, unit: str = "cost units") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span = max(t.makespan for t in timelines) or 1.0
    n_rows = sum(t.num_stages for t in timelines)
    fig_w = min(24.0, max(8.0, 0.35 * span + 2))
    titles = [title(tl, unit, int(fig_w * 72 / (9 * 0.55))) for tl in timelines]  # 9 pt, ~0.55 em per char
    extra = sum(t.count("\n") for t in titles)
    fig, axes = plt.subplots(len(timelines), 1, squeeze=False, sharex=True,
                             figsize=(fig_w, 1.0 + 0.55 * n_rows + 0.5 * len(timelines) + 0.2 * extra))
    for ax, tl, text in zip(axes[:, 0], timelines, titles):
        P = tl.num_stages
        row_stages = [sorted({iv.action.stage for iv in row}) for row in tl.compute]
        for s, row in enumerate(tl.compute):
            y = P - 1 - s
            for iv in row:
                k = iv.action.kind.value
                w = iv.end - iv.start
                chunk = row_stages[s].index(iv.action.stage)  # virtual stages: later chunks hatched
                ax.add_patch(plt.Rectangle((iv.start, y + 0.22), w, 0.66, facecolor=COLORS[k],
                                           edgecolor="black", linewidth=0.6, hatch=("", "//", "..", "xx")[chunk % 4]))
                if w >= 0.02 * span or w >= 0.4:
                    label = f"{iv.action.mb}" if k in "FB" else f"{k}{iv.action.mb}"
                    ax.text(iv.start + w / 2, y + 0.55, label, ha="center", va="center",
                            fontsize=7 if len(label) > 1 else 8)
        for c in tl.comm:
            y = P - 1 - c.sender
            lane = 0.02 if c.direction == "F" else 0.12
            ax.add_patch(plt.Rectangle((c.start, y + lane), max(c.end - c.start, 1e-3), 0.08,
                                       facecolor=COMM_COLORS[c.direction], edgecolor="white",
                                       linewidth=0.5))
        ax.set_ylim(-0.1, P)
        ax.set_yticks([P - 1 - s + 0.55 for s in range(P)])
        ax.set_yticklabels([f"stage {s}" if row_stages[s] in ([s], []) else
                            f"mesh {s} ({','.join(map(str, row_stages[s]))})" for s in range(P)])
        ax.set_title(text, fontsize=9, loc="left")
        ax.grid(axis="x", linestyle=":", linewidth=0.5)
        ax.set_axisbelow(True)
    axes[-1, 0].set_xlim(0, span * 1.01)
    axes[-1, 0].set_xlabel(f"time ({unit}" + (f"; a transfer takes {comm_cost:g}" if comm_cost else "") + ")")
    handles = [Patch(facecolor=COLORS[k], edgecolor="black", label=lbl) for k, lbl in
               [("F", "F forward"), ("B", "B backward"), ("I", "I input-grad"), ("W", "W weight-grad")]]
    handles += [Patch(facecolor=COMM_COLORS["F"], label="send activation"),
                Patch(facecolor=COMM_COLORS["B"], label="send gradient")]
    fig.legend(handles=handles, loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 if len(timelines) > 1 else 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        timelines = build_timelines(args)
    except (ValueError, NotImplementedError) as e:  # ScheduleError is a ValueError
        print(f"plot_schedule: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([t.summary() for t in timelines], indent=2))
    else:
        print(format_table(timelines, time_unit(args)))
    if args.output is not None:
        draw(timelines, args.output, args.comm if args.trace is None else 0.0, time_unit(args))
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
